"""`flash prepare hybrid|graft [PROFILE] [K=V…] [--dry-run] [--json] [--force]`: build a served layout."""

from __future__ import annotations

import argparse

from .. import hfcache, recipe
from ..errors import WeightsMissing
from ..output import print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="build <snapshot>-fp8hybrid (hybrid) or -fp8hybrid-mtpnvfp4 (graft)")
    p.add_argument("what", choices=("hybrid", "graft"), help="hybrid: fp8 side layers; graft: + NVFP4 MTP experts (RadixArk)")
    recipe.add_arguments(p)
    p.add_argument("--no-profile", action="store_true",
                   help="settings from defaults + environment + KEY=VALUE only (the scripts/ wrappers use this)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (files, bytes, disk); write nothing")
    p.add_argument("--force", action="store_true", help="rebuild even when the layout is ready")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    s = recipe.load(args.recipe, use_profile=not args.no_profile).settings
    snap = hfcache.resolve_snapshot(s["HF_CACHE"], s["MODEL"], s["REVISION"])
    if snap is None:
        raise WeightsMissing(f"no snapshot of {s['MODEL']} under {hfcache.repo_dir(s['HF_CACHE'], s['MODEL'])}",
                             hint="flash download")
    if args.what == "hybrid":
        from ..checkpoint import hybrid

        out = hybrid.prepare(snap, dry_run=args.dry_run, force=args.force)
        report = hybrid._report
    else:
        from ..checkpoint import graft

        out = graft.prepare(snap, s, dry_run=args.dry_run, force=args.force)
        report = graft._report
    if args.json:
        print_json(out)
    else:
        report(out)
        if out.get("dest"):
            print(out["dest"])
    return 0
