"""`flash verify [PROFILE] [K=V…] [--hash] [--path DIR] [--json]`: is the checkpoint complete and intact?"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import hfcache, recipe
from ..errors import WeightsMissing
from ..output import print_json
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help=summary("verify"))
    recipe.add_arguments(p)
    p.add_argument("--no-profile", action="store_true",
                   help="settings from defaults + environment + KEY=VALUE only (the scripts/ wrappers use this)")
    p.add_argument("--hash", action="store_true", help="also compare every blob's sha256 with the Hub's (reads all bytes)")
    p.add_argument("--path", type=Path, help="verify this checkpoint directory instead of the snapshot")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import verify

    targets: list[tuple[str, Path]] = []
    if args.path:
        targets.append(("path", args.path))
    else:
        s = recipe.load(args.recipe, use_profile=not args.no_profile).settings
        snap = hfcache.resolve_snapshot(s["HF_CACHE"], s["MODEL"], s["REVISION"])
        if snap is None:
            raise WeightsMissing(f"no snapshot of {s['MODEL']}{'@' + s['REVISION'] if s['REVISION'] else ''} under "
                                 f"{hfcache.repo_dir(s['HF_CACHE'], s['MODEL'])}", hint="flash download")
        targets.append(("snapshot", snap))
        if s["MODE"] != "nvfp4" and hfcache.variant_dir(snap, s["MODE"]).is_dir():
            targets.append((s["MODE"], hfcache.variant_dir(snap, s["MODE"])))
    out, bad = [], 0
    for what, d in targets:
        res = verify.verify(d, with_hash=args.hash and what in ("snapshot", "path"))
        bad += len(res.problems)
        out.append({"what": what, "dir": str(d), "ok": res.ok, "files": res.files, "index_keys": res.keys,
                    "tensors": res.tensors, "hashed_bytes": res.hashed_bytes, "problems": res.problems,
                    "warnings": res.warnings})
    if args.json:
        print_json(out)
    else:
        for r in out:
            mark = "✔" if r["ok"] else "✘"
            print(f"{mark} {r['what']}: {r['dir']}")
            print(f"    {r['index_keys']:,} index keys in {r['files']} files"
                  + (f", {r['hashed_bytes']:,} bytes hashed" if r["hashed_bytes"] else ""))
            for p in r["problems"]:
                print(f"    ✘ {p}")
            for w in r["warnings"]:
                print(f"    ! {w}")
    return 1 if bad else 0
