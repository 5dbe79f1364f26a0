"""`flash download [PROFILE] [K=V…] [--dry-run] [--json]`: the checkpoint into HF_CACHE (resumable)."""

from __future__ import annotations

import argparse

from .. import recipe
from ..output import print_json
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("download", help=summary("download"))
    recipe.add_arguments(p)
    p.add_argument("--no-profile", action="store_true",
                   help="settings from defaults + environment + KEY=VALUE only (the scripts/ wrappers use this)")
    p.add_argument("--dry-run", action="store_true", help="list the files and exact bytes; download nothing")
    p.add_argument("--json", action="store_true", help="machine-readable plan/result")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import download

    s = recipe.load(args.recipe, use_profile=not args.no_profile).settings
    plan = download.plan(s)
    if args.dry_run:
        if args.json:
            print_json(plan.as_dict())
            return 0
        print(f"{plan.model} @ {plan.commit} (asked: {plan.requested}) into {plan.cache}")
        for f in plan.files:
            state = "cached" if f.cached else (f"partial {f.partial}" if f.partial else "get")
            print(f"  {f.size:>16,}  {state:<18} {f.path}")
        for name in plan.excluded:
            print(f"  {'':>16}  {'excluded':<18} {name}")
        print(f"total {plan.bytes_total:,} B in {len(plan.files)} files; to download {plan.bytes_to_get:,} B; "
              f"free {plan.bytes_free:,} B")
        return 0
    snap = download.execute(plan, s)
    from ..checkpoint import verify

    res = verify.structure(snap)
    if args.json:
        print_json({"snapshot": str(snap), "commit": plan.commit, "ok": res.ok, "problems": res.problems})
    else:
        print(f"{snap}")
        for line in res.problems:
            print(f"  ✘ {line}")
    return 0 if res.ok else 1
