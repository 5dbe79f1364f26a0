"""argparse wiring only: each command module adds its own subparser (commands/__init__.py)."""

from __future__ import annotations

import argparse

from . import __version__
from .commands import COMMANDS, load

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flash",
        description="Serve Qwen3.8-Flash-Next on one NVIDIA DGX Spark with vLLM.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flash {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        load(name).register(sub)
    return parser
