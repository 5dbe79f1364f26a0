"""`flash logs [-f] [N]`: the container's log (rotated by Docker per LOG_MAX_SIZE/FILES)."""

from __future__ import annotations

import argparse
import sys

from .. import engine
from ..errors import UsageError
from ..settings import BY_NAME, resolve


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="show the server log")
    p.add_argument("lines", nargs="?", default="100", help="how many lines from the end (default 100)")
    p.add_argument("-f", "--follow", action="store_true", help="keep following")
    p.add_argument("--name", default=None, help=f"container name (default: NAME, {BY_NAME['NAME'].default})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    if not args.lines.isdigit():
        raise UsageError(f"N must be a number of lines, got {args.lines!r}", hint="e.g. flash logs -f 200")
    name = args.name or resolve(env=os.environ)["NAME"]
    container = engine.require(engine.connect(), name)
    n = int(args.lines)
    if not args.follow:
        print("\n".join(engine.tail(container, n)))
        return 0
    for chunk in engine.follow(container, n):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return 0
