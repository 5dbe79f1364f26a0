#!/usr/bin/env python3
"""Standalone fp8 side-layer converter: the same code path as `flash prepare hybrid`.

    tools/fp8_convert.py SRC_DIR [DST_DIR] [--dry-run] [--json]

SRC_DIR is any checkpoint directory with a model.safetensors.index.json (an HF cache snapshot or
a plain copy). DST_DIR defaults to SRC_DIR + "-fp8hybrid" (next to it, as the HF cache layout
wants). Untouched files become relative symlinks; rewritten shards and the two quant configs
(now MIXED_PRECISION with the side layers as FP8_PB_WO, `weight_scale` 4-D) real files; the
result is verified before `.prepared` is written and the directory renamed into place.
Convention: docs/decisions/hybrid-convention.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flash_cli.checkpoint import hybrid
from flash_cli.errors import FlashError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path, nargs="?")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    src = a.src.resolve() if not a.src.is_symlink() else a.src.absolute()
    dst = a.dst or src.with_name(src.name + "-fp8hybrid")
    try:
        p = hybrid.plan(src, dst)
        if a.dry_run:
            out = p.as_dict()
        else:
            out = hybrid.build(p)
    except FlashError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    if a.json:
        print(json.dumps(out, indent=2))
    elif a.dry_run:
        for r in out["rewrite"]:
            print(f"rewrite {r['file']}: {r['tensors']} tensors, {r['bytes_before']:,} → {r['bytes_after']:,} B")
        print(f"{out['tensors']} tensors; link {out['link']} files; need {out['bytes_needed']:,} B, free {out['bytes_free']:,} B")
    else:
        print(f"{dst}: {out['tensors']} tensors, worst per-block relative error {out['worst_block_rel_err']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
