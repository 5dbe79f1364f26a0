"""`flash conversations [FILE|-] [-n N] [--no-follow]`: the server's request log, threaded into
conversations (conversations.py); the container is found by label, like `flash logs`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterable, Iterator

from ..errors import UsageError
from ..settings import BY_NAME, resolve
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("conversations", help=summary("conversations"),
                       description="Follow the server's log and print each conversation in its own colour: only "
                       "new user turns and the assistant's outputs, reasoning and tool calls tagged. Needs the server "
                       "started with LOG_REQUESTS=1 (prompts and outputs in the log: private, and it grows).")
    p.add_argument("file", nargs="?", help="a saved log, or - for stdin (default: the container's log)")
    p.add_argument("--name", default=None, help=f"container name (default: NAME, {BY_NAME['NAME'].default})")
    p.add_argument("-n", "--lines", type=int, default=200, help="start this many lines back (default 200)")
    p.add_argument("--no-follow", action="store_true", help="print what is there and exit")
    p.add_argument("--no-stats", action="store_true", help="hide the engine stats lines")
    p.add_argument("--no-color", action="store_true", help="plain text (default on a TTY: colours)")
    p.set_defaults(func=run)


def lines(chunks: Iterable[str]) -> Iterator[str]:
    """Docker's log stream arrives in chunks that cut lines anywhere: whole lines out."""
    rest = ""
    for chunk in chunks:
        rest += chunk
        *done, rest = rest.split("\n")
        yield from done
    if rest:
        yield rest


def source(args: argparse.Namespace) -> Iterable[str]:
    if args.file == "-":
        return (line.rstrip("\n") for line in sys.stdin)
    if args.file:
        try:
            text = open(args.file, encoding="utf-8", errors="replace")
        except FileNotFoundError:
            raise UsageError(f"log file {args.file!r} not found", hint="a saved server log, - for stdin, or "
                             "nothing for the running container's log") from None
        return (line.rstrip("\n") for line in text)
    from .. import engine

    name = resolve(env=os.environ, overrides={"NAME": args.name} if args.name else None)["NAME"]
    container = engine.require(engine.connect(), name)
    if args.no_follow:
        return iter(engine.tail(container, args.lines))
    return lines(engine.follow(container, args.lines))


def run(args: argparse.Namespace) -> int:
    from ..conversations import Watcher

    if args.lines < 0:
        raise UsageError(f"-n {args.lines}: a number of lines is 0 or more", hint="e.g. flash conversations -n 500")
    w = Watcher(sys.stdout, colour=sys.stdout.isatty() and not args.no_color, show_stats=not args.no_stats)
    for line in source(args):
        w.feed(line)
    if w.requests == 0:
        print("no request lines seen; serve with LOG_REQUESTS=1 to log prompts and outputs", file=sys.stderr)
    return 0
