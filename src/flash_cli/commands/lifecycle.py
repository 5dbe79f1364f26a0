"""`flash stop` (drains running requests first, bounded), `flash start`, `flash rm|down`."""

from __future__ import annotations

import argparse
import os

from .. import engine, recipe, running
from ..running import drain  # running.py owns it (serve and deploy drain too)
from ..output import say
from ..spec import LABEL
from . import summary

STOP_GRACE = 30  # seconds Docker waits after SIGTERM before SIGKILL


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stop", help=summary("stop"),
                       description="Wait for running requests to finish (at most DRAIN_TIMEOUT s), then stop.")
    recipe.add_arguments(p)
    p.add_argument("--no-drain", action="store_true", help="do not wait for running requests")
    p.add_argument("--dry-run", action="store_true", help="say what would happen; change nothing")
    p.set_defaults(func=stop)
    p = sub.add_parser("start", help=summary("start"))
    recipe.add_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="say what would happen; change nothing")
    p.set_defaults(func=start)
    p = sub.add_parser("rm", aliases=["down"], help=summary("rm"))
    recipe.add_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    p.set_defaults(func=rm)


def _target(args: argparse.Namespace):
    r = recipe.load(args.recipe)
    client = engine.connect()
    return r, engine.require(client, r.settings["NAME"])


def _deployment(args: argparse.Namespace):
    """(settings, every box) when NAME is a multi-node deployment, else (settings, None)."""
    from .. import deploy

    r = recipe.load(args.recipe)
    return r.settings, deploy.locate(r.settings)


def stop(args: argparse.Namespace) -> int:
    s, boxes = _deployment(args)
    if boxes is not None:
        from .. import deploy

        return deploy.stop(boxes, 0 if args.no_drain else s["DRAIN_TIMEOUT"], args.dry_run)
    r = recipe.load(args.recipe)
    c = engine.find(engine.connect(), r.settings["NAME"])
    if c is None:  # idempotent, like status: the state stop asks for is already there
        print(f"no flash container named {r.settings['NAME']!r}; nothing to stop")
        return 0
    st = engine.state(c)
    if st.status != "running":
        print(f"{c.name} is {st.status}; nothing to stop")
        return 0
    if args.dry_run:
        print(f"would drain (at most {r.settings['DRAIN_TIMEOUT']} s) and stop {engine.describe(c)}")
        return 0
    if not args.no_drain and r.settings["DRAIN_TIMEOUT"] > 0:
        left, waited = drain(running.endpoint(c), r.settings["DRAIN_TIMEOUT"])
        if left:
            say(f"  ! {left:.0f} request(s) still running after {waited:.0f} s; stopping anyway")
    c.stop(timeout=STOP_GRACE)
    print(f"{c.name} stopped (kept; flash start reloads the same recipe, ~8-13 min on a Spark)")
    return 0


def start(args: argparse.Namespace) -> int:
    _, boxes = _deployment(args)
    if boxes is not None:
        from .. import deploy

        return deploy.start(boxes, args.dry_run)
    _, c = _target(args)
    st = engine.state(c)
    if st.status == "running":
        print(f"{c.name} is already running")
        return 0
    if args.dry_run:
        print(f"would start {engine.describe(c)}")
        return 0
    c.start()
    print(f"{c.name} starting; next: flash wait")
    return 0


def rm(args: argparse.Namespace) -> int:
    _, boxes = _deployment(args)
    if boxes is not None:
        from .. import deploy

        return deploy.rm(boxes, args.dry_run)
    r, c = _target(args)
    st = engine.state(c)
    what = engine.describe(c)
    volumes = [m.get("Name") for m in c.attrs.get("Mounts", []) if m.get("Type") == "volume"]
    verb = "would remove" if args.dry_run else "removed"
    if not args.dry_run:
        c.remove(force=True)
    print(f"{verb} container {what}, which was {st.status}")
    if volumes:
        print(f"kept volumes: {', '.join(v for v in volumes if v)} (compile caches; docker volume rm to drop)")
    key = os.path.exists(running.state.api_key_path(c.name))
    if key and c.labels.get(f"{LABEL}.api-key") == "required":
        print(f"kept the API key {running.state.api_key_path(c.name)}")
    return 0
