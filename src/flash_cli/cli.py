"""argparse wiring only: each command module adds its own subparser (commands/__init__.py)."""

from __future__ import annotations

import argparse

from . import __version__
from typing import Sequence

from .commands import TABLE, load, module_for

EPILOG = """\
examples:
  flash doctor                      check the host, Docker, image and weights for the default profile
  flash setup                       build the image, download and prepare the weights (idempotent)
  flash serve default               start the server; then: flash wait && flash test
  flash serve default MTP=3 PORT=18301 --dry-run
                                    print the exact docker run line and vllm argv, run nothing
  flash profiles                    list the recipes; flash profiles show NAME for one

settings: defaults < profile < environment < KEY=VALUE arguments; see docs/SETTINGS.md
debug: FLASH_DEBUG=1 shows tracebacks
"""


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Full parser for the command named in argv, one-line stubs for all the others;
    argv=None builds every command's full parser (tests, docs)."""
    parser = argparse.ArgumentParser(
        prog="flash",
        description="Serve Qwen3.8-Flash-Next on one NVIDIA DGX Spark with vLLM.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flash {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    word = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    chosen = module_for(word)
    for name, (module, help_text, aliases) in TABLE.items():
        if name in sub.choices:  # registered with a sibling of its module (stop, start, rm)
            continue
        if argv is None or module == chosen:
            load(module).register(sub)
        else:
            sub.add_parser(name, help=help_text, aliases=list(aliases), add_help=False)
    return parser
