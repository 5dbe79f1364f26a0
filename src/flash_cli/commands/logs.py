"""`flash logs [-f] [N]`: the container's log (rotated by Docker per LOG_MAX_SIZE/FILES)."""

from __future__ import annotations

import argparse
import sys

from .. import engine
from ..errors import UsageError
from ..settings import BY_NAME, resolve
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help=summary("logs"))
    p.add_argument("lines", nargs="?", default="100", help="how many lines from the end (default 100)")
    p.add_argument("-f", "--follow", action="store_true", help="keep following")
    p.add_argument("--name", default=None, help=f"container name (default: NAME, {BY_NAME['NAME'].default})")
    p.add_argument("--node", default=None, metavar="N",
                   help="a multi-node deployment's box N (0 = head; default 0), or `router` (pd's P/D router); "
                        "boxes from NODES or the head's labels")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    if not args.lines.isdigit():
        raise UsageError(f"N must be a number of lines, got {args.lines!r}", hint="e.g. flash logs -f 200")
    s = resolve(env=os.environ, overrides={"NAME": args.name} if args.name else None)
    name = s["NAME"]
    n = int(args.lines)
    from .. import deploy

    if args.node is not None and not (args.node.isdigit() or args.node == deploy.ROUTER):
        raise UsageError(f"--node {args.node!r} is neither a box number nor {deploy.ROUTER!r}",
                         hint="--node 0 (head), --node 1, or --node router (pd)")
    boxes = deploy.locate(s)  # a deployment: its boxes by label (NODES or the local head's labels)
    if boxes is None and args.node not in (None, "0"):
        raise UsageError(f"--node {args.node}: {name} is not a multi-node deployment",
                         hint="NODES=… names the boxes when the head is not on this machine")
    if boxes is not None:
        node = args.node or "0"
        return deploy.logs(boxes, str(int(node)) if node.isdigit() else node, n, args.follow)
    container = engine.require(engine.connect(), name)
    if not args.follow:
        print("\n".join(engine.tail(container, n)))
        return 0
    for chunk in engine.follow(container, n):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return 0
