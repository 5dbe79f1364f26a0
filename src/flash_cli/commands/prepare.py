"""`flash prepare hybrid|graft [PROFILE] [K=V…] [--dry-run] [--json] [--force]`: build a served layout."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import hfcache, recipe
from ..errors import UsageError, WeightsMissing
from ..output import print_json, say
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help=summary("prepare"))
    p.add_argument("what", choices=("hybrid", "graft"), help="hybrid: fp8 side layers; graft: + NVFP4 MTP experts (RadixArk)")
    recipe.add_arguments(p)
    p.add_argument("--no-profile", action="store_true",
                   help="settings from defaults + environment + KEY=VALUE only (the scripts/ wrappers use this)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (files, bytes, disk); write nothing")
    p.add_argument("--force", action="store_true", help="rebuild even when the layout is ready")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.add_argument("--source", type=Path, metavar="DIR", help="hybrid: convert this checkpoint directory (any "
                   "copy with a model.safetensors.index.json) instead of MODEL's snapshot under HF_CACHE")
    p.add_argument("--dest", type=Path, metavar="DIR", help="hybrid with --source: where the layout goes "
                   "(default: DIR-fp8hybrid next to it, as the HF cache layout has it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import known

    if args.source or args.dest:
        if args.what != "hybrid" or not args.source:
            raise UsageError(f"--source/--dest: {'prepare hybrid only' if args.what != 'hybrid' else '--dest needs --source'}",
                             hint="flash prepare hybrid --source DIR [--dest DIR]")
        known.check_mode(str(args.source), "hybrid", args.source)  # the layout read from DIR's index
        out = _prepare_hybrid_dir(args.source, args.dest, dry_run=args.dry_run)
    else:
        s = recipe.load(args.recipe, use_profile=not args.no_profile).settings
        snap = _snapshot(s)
        known.check_mode(s["MODEL"], STEPS[args.what].mode, snap)
        out = STEPS[args.what].prepare(snap, s, dry_run=args.dry_run, force=args.force)
    if args.json:
        print_json(out)
    else:
        STEPS[args.what].report(out)
        if out.get("dest"):
            print(out["dest"])
    return 0


def _snapshot(s) -> Path:
    snap = hfcache.resolve_snapshot(s["HF_CACHE"], s["MODEL"], s["REVISION"])
    if snap is None:
        raise WeightsMissing(f"no snapshot of {s['MODEL']} under {hfcache.repo_dir(s['HF_CACHE'], s['MODEL'])}",
                             hint="download it first: flash download")
    return snap


# --- the two variant builders, as `flash prepare` and `flash setup` run and report them ---------

def _prepare_hybrid(snap: Path, s, dry_run: bool, force: bool = False) -> dict:
    from ..checkpoint import hybrid

    return hybrid.prepare(snap, dry_run=dry_run, force=force, progress=say)


def _prepare_hybrid_dir(source: Path, dest: Path | None, dry_run: bool) -> dict:
    """The hybrid step on any checkpoint directory (the same plan and variant transaction as a
    snapshot's): a symlinked source is kept as named, so its links resolve as the cache's do."""
    from ..checkpoint import hybrid

    source = source.absolute() if source.is_symlink() else source.resolve()
    dest = (dest or source.with_name(source.name + hfcache.VARIANT_SUFFIX["hybrid"])).absolute()
    p = hybrid.plan(source, dest)
    if dry_run:
        return {"action": "build", "state": "absent", "plan": p.as_dict()}
    dest.parent.mkdir(parents=True, exist_ok=True)  # the transaction builds its .partial beside dest
    return {"action": "built", "state": "ready", "dest": str(dest), "marker": hybrid.build(p, progress=say)}


def _prepare_graft(snap: Path, s, dry_run: bool, force: bool = False) -> dict:
    from ..checkpoint import graft

    return graft.prepare(snap, s, dry_run=dry_run, force=force, progress=say)


def _report_hybrid(out: dict) -> None:
    action = out["action"]
    if action == "none":
        say(f"  ✔ hybrid already prepared: {out['dest']}")
    elif action in ("repair", "repaired"):
        say(f"  ✔ hybrid {action}: {out['dest']}" + (f" (linked {', '.join(out.get('added', []))})" if out.get("added") else ""))
    elif action == "build":
        p = out["plan"]
        say(f"  would build {p['dest']}: {p['tensors']} tensors in {len(p['rewrite'])} files, "
            f"{p['bytes_needed'] / 1e9:.2f} GB needed, {p['bytes_free'] / 1e9:.2f} GB free")
    else:
        m = out["marker"]
        say(f"  ✔ built {out['dest']}: {m['tensors']} tensors, worst block rel err {m['worst_block_rel_err']:.4f}, "
            f"{m['seconds']} s")


def _report_graft(out: dict) -> None:
    if out["action"] == "none":
        say(f"  ✔ graft already prepared: {out['dest']}")
    elif out["action"] == "build":
        say(f"  would build {out['dest']} with the NVFP4 MTP experts of {out['donor']}")
    else:
        m = out["marker"]
        say(f"  ✔ built {out['dest']}: −{len(m['removed'])} fused tensors, +{m['added_keys']} donor keys, "
            f"{m['excludes']} exclude entries")


@dataclass(frozen=True)
class VariantStep:
    """A variant as a `flash setup` step (is_done/run_step) and a `flash prepare` target."""

    mode: str  # hfcache variant mode: "hybrid" | "hybrid-mtp"
    prepare: Callable[..., dict]
    report: Callable[[dict], None]

    def is_done(self, settings) -> bool:
        snap = hfcache.resolve_snapshot(settings["HF_CACHE"], settings["MODEL"], settings["REVISION"])
        return snap is not None and hfcache.variant_state(snap, self.mode) == "ready"

    def run_step(self, settings, dry_run: bool) -> dict:
        from ..checkpoint import known

        snap = _snapshot(settings)
        known.check_mode(settings["MODEL"], self.mode, snap)
        out = self.prepare(snap, settings, dry_run=dry_run)
        self.report(out)
        return out


STEPS = {
    "hybrid": VariantStep("hybrid", _prepare_hybrid, _report_hybrid),
    "graft": VariantStep("hybrid-mtp", _prepare_graft, _report_graft),
}
