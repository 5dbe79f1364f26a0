"""`flash profiles` (list) and `flash profiles show NAME` (every resolved setting and its source)."""

from __future__ import annotations

import argparse
import os

from .. import profiles as prof
from ..output import print_json
from ..settings import BY_NAME, resolve
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profiles", help=summary("profiles"))
    p.add_argument("action", nargs="?", choices=("list", "show"), default="list")
    p.add_argument("name", nargs="?", help="profile to show")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "show" or args.name:
        return show(args.name or "default", args.json)
    rows = [prof.load(n) for n in prof.names()]
    if args.json:
        print_json([{"name": p.name, "base": p.base or BY_NAME["BASE"].default, "desc": p.desc,
                     "values": p.values} for p in rows])
        return 0
    width = max(len(p.name) for p in rows) + 2
    print(f"{'PROFILE':<{width}}{'BASE':<8}WHAT")
    for p in rows:
        print(f"{p.name:<{width}}{p.base or BY_NAME['BASE'].default:<8}{p.desc}")
    print("\nserve one: ./flash serve <profile>   override anything: ./flash serve default MTP=3 PORT=18301")
    print("a profile is a plain env file in profiles/; copy one to make your own.")
    return 0


def show(name: str, as_json: bool) -> int:
    p = prof.load(name)
    settings = resolve(p.layer(), os.environ, profile_name=p.name)
    if as_json:
        print_json({"name": p.name, "desc": p.desc, "base": settings["BASE"],
                    "settings": {k: {"value": BY_NAME[k].format(v), "source": settings.source[k]}
                                 for k, v in settings.values.items()}})
        return 0
    print(f"# {p.name}: {p.desc}")
    for key, value in settings.values.items():
        src = settings.source[key]
        print(f"{key}={BY_NAME[key].format(value)}" + (f"    # {src}" if src != "default" else ""))
    return 0
