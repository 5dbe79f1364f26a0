#!/usr/bin/env python3
"""Regenerate the calibration and profile tables in docs/PLAN.md from the planner itself.
`--check` exits 1 when the file drifted from the code (a unit test runs it)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from flash_cli import profiles
from flash_cli.plan import calibration as cal, deployed, fitting
from flash_cli.plan.hardware import PRESETS
from flash_cli.settings import resolve

ROOT = Path(__file__).resolve().parents[1]

DOC = ROOT / "docs" / "PLAN.md"


def fmt(value: float, unit: str) -> str:
    if unit in ("tokens", "delta"):
        return f"{value:,.0f} tokens"
    if unit == "gib":
        return f"{value:.2f} GiB"
    return f"×{value:.3f}"


def calibration_table() -> str:
    rows = ["| figure | published (source) | predicted | error | asserted |", "|---|---|---|---|---|"]
    for f in cal.FIGURES:
        p = fitting.predict(f)
        err = fitting.error_pct(f, p)
        tol = "fit" if f.key == cal.FIT_FIGURE else ("not modeled" if f.tolerance_pct is None else f"±{f.tolerance_pct:g}%")
        note = f" ({f.note})" if f.note else ""
        rows.append(f"| `{f.key}`: {f.what}{note} | {fmt(f.published, f.unit)} ({f.source}) | {fmt(p, f.unit)} "
                    f"| {err:+.2f}% | {tol} |")
    return "\n".join(rows)


def profiles_table() -> str:
    rows = ["| profile | base | KV pool (tokens) | expected range | concurrency at CTX | KV GiB | weights GiB | page cache for the table |",
            "|---|---|---|---|---|---|---|---|"]
    for name in profiles.names():
        prof = profiles.load(name)
        p = deployed(resolve(prof.layer(), None, None, profile_name=name), PRESETS["gb10"], snapshot=None)
        lo, hi = p["kv_cache_tokens_range"]
        if "parallel" in p:  # several boxes: the row is one box; the deployment's pool(s) after it
            agg = p["parallel"]
            name = (f"{name} (one-box plan; deployment: {agg['pools']} pool(s), ~{agg['aggregate']['kv_cache_tokens']:,} "
                    f"tokens{', first-order' if agg['pools'] == 1 else ''})")
        rows.append(f"| {name} | {p['recipe']['BASE']} | {p['kv_cache_tokens']:,} | {lo:,}–{hi:,} | "
                    f"{p['max_concurrency']:.2f} × {p['max_concurrency_at']:,} | {p['kv_cache_gib']} | {p['weights_gib']} | "
                    f"{p['host']['page_cache_for_ple_gib']} GiB |")
    return "\n".join(rows)


def render(text: str) -> str:
    for tag, body in (("calibration", calibration_table()), ("profiles", profiles_table())):
        pattern = re.compile(rf"(<!-- {tag}:begin -->\n).*?(<!-- {tag}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"docs/PLAN.md lacks the <!-- {tag}:begin/end --> markers")
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/PLAN.md is out of date")
    args = ap.parse_args()
    old = DOC.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("docs/PLAN.md is out of date: run tools/gen_plan_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print("wrote docs/PLAN.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
