"""Entry point: parse, dispatch, and map typed errors to exit codes and one-line hints."""

from __future__ import annotations

import os
import sys
from typing import Sequence

from .errors import INTERRUPTED_EXIT, DockerUnavailable, FlashError, os_cause


def main(argv: Sequence[str] | None = None) -> int:
    from .cli import build_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    # KEY=VALUE words may follow options (`serve default --dry-run MTP=3`): argparse stops
    # collecting a nargs="*" positional at the first option, so fold the rest back in here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "recipe") and not any(e.startswith("-") for e in extra):
            args.recipe = [*args.recipe, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except FlashError as err:
        if os.environ.get("FLASH_DEBUG") == "1":
            raise
        print(f"Error: {err}", file=sys.stderr)
        if err.hint:
            print(f"hint: {err.hint}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except BrokenPipeError:  # `flash … | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except Exception as err:  # noqa: BLE001 - the engine's own errors become one line, not a traceback
        if os.environ.get("FLASH_DEBUG") == "1" or not type(err).__module__.startswith(("docker.", "requests.", "urllib3.")):
            raise
        if os_cause(err) is not None:  # the Engine went away mid-command: the same one line as connect's
            from .engine import host

            lost = DockerUnavailable.unreachable(host(), err)
            print(f"Error: {lost}\nhint: {lost.hint}", file=sys.stderr)
            return lost.exit_code
        print(f"Error: the Docker Engine failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}", file=sys.stderr)
        print("hint: is dockerd overloaded or stuck? docker info; FLASH_DEBUG=1 shows the traceback", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
