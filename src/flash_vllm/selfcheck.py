"""`python -m flash_vllm.selfcheck [--json] [--assume-base vX.Y]`: the patch matrix for this vLLM.

For every patch, on the installed vLLM (no GPU needed):
- meant for this base: `check()` (targets look as expected), `apply()` twice (idempotent),
  `verify()` (targets and stale bindings point to our replacements) -> `applies` or `broken`;
- upstream here: `upstream_check()` confirms the fix is in the release -> `upstream` or `broken`;
- otherwise `not-needed` / `not-ported` (documented reasons).

Every patch is applied regardless of its runtime gate (gates are serving-time env), so run it in
a throwaway process: the Dockerfile's last build step, the verification tier, and
`flash patches` (inside the image). Exit status 1 if any patch meant for this base is broken.
The compile-cache key's hook (flash_vllm/compile_key.py, not a numbered patch) is checked too. The
last line of `--json` output is one JSON object: {"release", "base", "patchset", "patches":
[{"number", "name", "status", "detail", "folder", "traced"}], "compile_key": {"status", "detail"}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from . import compat, compile_key
from .registry import Context, catalogue, patchset_hash


def evaluate(ctx: Context) -> list[dict]:
    rows = []
    for p in catalogue():
        expected = p.expected_status(ctx.base.name)
        status, detail = expected, ""
        try:
            if expected == "applies":
                p.check(ctx)
                p.apply(ctx)
                p.apply(ctx)  # idempotent: a second application changes nothing
                p.verify(ctx)
            elif expected == "upstream" and p.upstream_check is not None:
                p.upstream_check(ctx)
            elif expected == "not-ported":
                detail = p.not_ported[ctx.base.name]
        except Exception as e:  # any failure of a patch meant for this release is "broken"
            status, detail = "broken", f"{type(e).__name__}: {e}"
            if os.environ.get("FLASH_DEBUG"):
                traceback.print_exc()
        rows.append({"number": p.number, "name": p.name, "status": status, "detail": detail, "folder": p.folder,
                     "traced": list(p.traced)})
    return rows


def evaluate_key(ctx: Context, rows: list[dict]) -> dict:
    """The compile-cache key (not a numbered patch, always on): its hook binds on this release."""
    try:
        sig = compile_key.install(ctx, [r["number"] for r in rows if r["status"] == "applies"])  # checks and verifies
        return {"status": "applies", "detail": f"{':'.join(compile_key.TARGET)} (key {sig['key']})"}
    except Exception as e:
        if os.environ.get("FLASH_DEBUG"):
            traceback.print_exc()
        return {"status": "broken", "detail": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flash_vllm.selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    ap.add_argument("--assume-base", help="evaluate against this base (a newer release)")
    ap.add_argument("--expect-patchset", help="fail unless the installed patch set has this hash "
                    "(the Dockerfile's org.flash.patchset label)")
    ap.add_argument("--patchset-only", action="store_true",
                    help="only compare the patch-set hash (needs no vLLM)")
    args = ap.parse_args(argv)
    if args.expect_patchset is not None and args.expect_patchset != patchset_hash():
        print(f"selfcheck: installed patch set {patchset_hash()} != expected {args.expect_patchset}; "
              "run tools/gen_patches_doc.py to refresh the Dockerfiles' PATCHSET", file=sys.stderr)
        return 1
    if args.patchset_only:
        print(f"flash_vllm patch set {patchset_hash()}")
        return 0
    env = dict(os.environ)
    # Every patch's logic is exercised: switch the gates that select code paths on.
    env.setdefault("VLLM_QSA_EXACT_TOPK", "1")
    try:
        version = compat.installed_vllm_version()
        base = compat.resolve(version, env, assume=args.assume_base)
    except compat.CompatError as e:
        print(f"selfcheck: {e}", file=sys.stderr)
        return 2
    ctx = Context(base, env)
    rows = evaluate(ctx)
    key = evaluate_key(ctx, rows)
    broken = [r for r in rows if r["status"] == "broken"] + ([{"number": "compile-key"}] if key["status"] == "broken" else [])
    out = {"release": version, "base": base.name, "provisional": base.provisional,
           "patchset": patchset_hash(), "patches": rows, "compile_key": key}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"flash_vllm selfcheck: vLLM {version}, base {base.name}, patch set {out['patchset']}")
        for r in rows:
            print(f"  {r['number']:>2} {r['name']:<22} {r['status']:<11} {r['detail']}")
        print(f"   - {'compile-cache key':<22} {key['status']:<11} {key['detail']}")
        print("OK" if not broken else f"BROKEN: {', '.join(str(r['number']) for r in broken)}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
