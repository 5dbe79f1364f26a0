"""What a deeper MTP draft must earn: from a recipe run's paired step times, the acceptance at which
one draft depth breaks even with another.

With random weights every draft is rejected (acceptance length 1.00), so bench_recipe measures
only the cost side of MTP depth: a step that drafts d tokens and verifies d + 1. Which depth is
faster for a user depends on how many drafts are accepted. Under the usual model (each draft
position accepted with the same probability p, given the ones before it), a step yields
1 + p + ... + p^d tokens on average, so depth b beats depth a (b > a) when

    tokens(p, b) / tokens(p, a)  >  step(b) / step(a).

The left side rises from 1 (p = 0) to (b + 1) / (a + 1) (p = 1); the p where it meets the measured
step ratio is the break-even acceptance. Only servers whose argv differ in `--speculative-config`
alone are compared (the same patches, the same everything else), at the same cell, cycle and round.
The depth at a cell is the schedule's K for min(c, --max-num-seqs) running requests.

`--model` adds what lab/decode/pieces.py's step model says of depth, an estimate. A step at depth d
verifies c(d + 1) tokens, which touch a share cov(c(d + 1)) of the routed experts, and runs d draft
passes (the MTP layer and patch 10's 65,536-row head):

    step(c, d) = idle + E (cov(c(d + 1)) - cov(3)) + s (c(d + 1) - 3) + (d - 2) draft(c)

with idle, E and s as pieces.py fits them at depth 2 (the H100's from its decode steps, the GB10's
narrowed by a published Spark ladder) and draft(c) the pass's bytes at a share of the card's
bandwidth. The H100 corners are checked against the run's measured step ratios (no depth other
than 2 was in their fit); the GB10 table is the same model with the GB10 corners: an estimate, each
figure the range over its corners, not a statistical interval.

    python -m lab.decode.mtp_depth RAW.jsonl [--json OUT] [--model]
"""

from __future__ import annotations

import argparse
import json
import sys

from flash_cli.plan.weights import DRAFT_VOCAB_ROWS  # patch 10's draft head, as the planner books it
from lab.decode import model, pieces, recipe_report

SPEC_FLAG, SEQS_FLAG, PORT_FLAG = "--speculative-config", "--max-num-seqs", "--port"
BW_FRACTION = pieces.GB10_BW_FRACTION   # the share of peak bandwidth a draft pass reads at (the H100 fit's .. peak)
GB10_PAIRS = ((1, 2), (2, 3), (2, 4), (3, 4))
GB10_CONCURRENCY = (1, 2, 4, 8)    # 8: the profiles' SEQS


def tokens_per_step(p: float, depth: int) -> float:
    """Expected tokens a step yields: the verified token plus each accepted draft."""
    return sum(p ** k for k in range(depth + 1))


def break_even(lo: int, hi: int, step_ratio: float) -> float | None:
    """The per-position acceptance p at which depth `hi` yields step_ratio times depth `lo`'s
    tokens; 0.0 when the deeper step is no slower, None when even p = 1 cannot pay for it."""
    if not 0 <= lo < hi:
        raise ValueError(f"depths must satisfy 0 <= lo < hi (got lo={lo}, hi={hi})")
    if step_ratio <= 1.0:
        return 0.0
    if step_ratio >= (hi + 1) / (lo + 1):
        return None
    a, b = 0.0, 1.0  # the gain ratio rises monotonically in p: bisect
    for _ in range(60):
        mid = (a + b) / 2
        if tokens_per_step(mid, hi) / tokens_per_step(mid, lo) < step_ratio:
            a = mid
        else:
            b = mid
    return (a + b) / 2


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def running(argv: list[str], concurrency: int) -> int:
    """The streams that decode together: the rest wait for a --max-num-seqs slot."""
    seqs = _value(argv, SEQS_FLAG)
    return min(concurrency, int(seqs)) if seqs else concurrency


def depth(argv: list[str], concurrency: int) -> int:
    """Draft tokens a step carries at `concurrency` streams: the schedule's K for the running
    batch (capped by --max-num-seqs), else num_speculative_tokens; 0 without MTP."""
    spec = _value(argv, SPEC_FLAG)
    if not spec:
        return 0
    spec = json.loads(spec)
    n = running(argv, concurrency)
    for lo, hi, k in spec.get("num_speculative_tokens_per_batch_size") or []:
        if lo <= n <= hi:
            return int(k)
    return int(spec.get("num_speculative_tokens", 0))


def _rest(argv: list[str]) -> list[str]:
    """The argv without what may differ between two servers of one comparison: the speculative
    config and the port."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in (SPEC_FLAG, PORT_FLAG):
            skip = True
        else:
            out.append(a)
    return out


def servers(rows: list[dict]) -> dict[tuple[int, str], dict]:
    """{(run, label): the first booted row}: later boots of a label render the same argv."""
    out: dict = {}
    for r in rows:
        if r.get("event") == "booted":
            out.setdefault((r.get("run", 0), r["label"]), r)
    return out


def comparisons(rows: list[dict]) -> list[dict]:
    """Each (shallower, deeper) pair of comparable servers at each cell: the paired step ratios
    (deeper / shallower, step = acceptance length / per-stream tok/s) and the break-even p of the
    geometric mean and of its interval's ends."""
    boots = servers(rows)
    steps = {(r.get("run", 0), r["label"], recipe_report.cell(r), r["repeat"]):
             (r.get("mtp_acceptance_length") or 1.0) / r["per_stream_tok_s"]
             for r in rows if r.get("per_stream_tok_s") and "repeat" in r}
    out = []
    for run, c in sorted({(run, c) for run, _, c, _ in steps}, key=lambda k: (k[0], recipe_report._cell_order(k[1]))):
        conc = int(c.split()[0][2:])
        labels = sorted(lab for (rn, lab) in boots if rn == run)
        for i, x in enumerate(labels):
            for y in labels[i + 1:]:
                ax, ay = boots[(run, x)]["argv"], boots[(run, y)]["argv"]
                if _rest(ax) != _rest(ay) or boots[(run, x)].get("env") != boots[(run, y)].get("env"):
                    continue
                dx, dy = depth(ax, conc), depth(ay, conc)
                if dx == dy:
                    continue
                (shallow, ds), (deep, dd) = sorted(((x, dx), (y, dy)), key=lambda t: t[1])
                ratios = [steps[(run, deep, c, rep)] / v for (rn, lab, cc, rep), v in steps.items()
                          if rn == run and lab == shallow and cc == c and (run, deep, c, rep) in steps]
                if not ratios:
                    continue
                row = recipe_report.interval(ratios)
                lo_hi = row.get("ci95")
                p = break_even(ds, dd, row["geomean"])
                out.append({"run": run, "cell": c, "shallow": shallow, "deep": deep, "depths": [ds, dd],
                            "step_ratio": row, "break_even_p": _round(p),
                            "break_even_p_ci95": [_round(break_even(ds, dd, v)) for v in lo_hi] if lo_hi else None,
                            # what vLLM logs as "Mean acceptance length" at the shallow depth when p is
                            # at break-even: a server above it would be faster at the deeper depth
                            "break_even_length_shallow": None if p is None else round(tokens_per_step(p, ds), 3),
                            "tokens_ratio_at_p1": round((dd + 1) / (ds + 1), 3)})
    return out


def draft_ms(c: int, gbs: float) -> float:
    """One draft pass of c streams read at `gbs` GB/s: patch 10's head (bf16), the MTP layer's side
    weights and the share of its FP8 experts c tokens touch."""
    head = DRAFT_VOCAB_ROWS * model.HIDDEN * 2
    experts = model.EXPERTS * 3 * model.HIDDEN * model.MOE_INTER * model.EXPERT_BYTES["fp8"]
    return (head + model.SIDE_PARAMS + experts * pieces.coverage(c)) / (gbs * 1e9) * 1000.0


def model_step(c: int, d: int, corner: dict, draft: float) -> float:
    """The modelled decode step (ms) of c streams at depth d; at d = model.MTP it is pieces.decode_step."""
    t, base = c * (d + 1), pieces.STREAM_TOKENS
    return (corner["idle"] + corner["e"] * (pieces.coverage(t) - pieces.coverage(base))
            + corner["s"] * (t - base) + (d - model.MTP) * draft)


def _ratios(c: int, lo: int, hi: int, corners: list[dict], peak_gbs: float) -> list[float]:
    return [model_step(c, hi, k, draft_ms(c, peak_gbs * f)) / model_step(c, lo, k, draft_ms(c, peak_gbs * f))
            for k in corners for f in BW_FRACTION]


def _p_range(lo: int, hi: int, ratios: list[float]) -> list[float | None]:
    ps = [break_even(lo, hi, r) for r in ratios]
    return [None, None] if None in ps else [round(min(ps), 3), round(max(ps), 3)]


def h100_check(rows: list[dict], table: list[dict]) -> list[dict]:
    """The H100 corners' step ratios (fitted at depth 2 on another run) against each measured
    comparison of the run, at the run's own idle step (stock's, else the shallow server's, c=1 p=64)."""
    corners = [k for k in pieces.h100_corners()[0] if k["from"] != "bytes at peak"]
    med = recipe_report.report(rows)["step_ms"]
    boots = servers(rows)
    out = []
    for t in table:
        idle_from = "stock" if "c=1 p=64" in med.get("stock", {}) else t["shallow"]
        idle = med[idle_from]["c=1 p=64"]["step"]
        c = running(boots[(t["run"], t["shallow"])]["argv"], int(t["cell"].split()[0][2:]))
        ratios = _ratios(c, *t["depths"], [k | {"idle": idle} for k in corners], pieces.H100_PEAK_GBS)
        m = t["step_ratio"]
        out.append({"cell": t["cell"], "running": c, "depths": t["depths"], "measured": m["geomean"], "measured_ci95": m.get("ci95"),
                    "predicted": [round(min(ratios), 3), round(max(ratios), 3)],
                    "idle_ms": idle, "idle_from": f"{idle_from} c=1 p=64"})
    return out


def gb10_table() -> dict:
    """The GB10 (48 layers) estimate: for each concurrency and depth pair, the modelled step ratio
    and break-even p over pieces' field-narrowed corners and BW_FRACTION of 273 GB/s for a draft."""
    corners, fit = pieces.gb10_field_corners()
    rows = []
    for c in GB10_CONCURRENCY:
        for lo, hi in GB10_PAIRS:
            ratios = _ratios(c, lo, hi, corners, pieces.GB10_GBS)
            rows.append({"concurrency": c, "depths": [lo, hi], "step_ratio": [round(min(ratios), 3), round(max(ratios), 3)],
                         "break_even_p": _p_range(lo, hi, ratios)})
    return {"estimate": "pieces.py's step model with the draft depth; GB10 corners narrowed by a published Spark ladder",
            "corners": len(corners), "idle_ms": fit["idle_kept_ms"], "ladder_rms_log_error": fit["rms_log_error"],
            "rows": rows}


def _round(p: float | None) -> float | None:
    return None if p is None else round(p, 3)


def render(table: list[dict]) -> str:
    def p(v):
        return "never" if v is None else f"{v:.3f}"

    lines = [f"{'cell':<14}{'shallow (depth)':<22}{'deep (depth)':<24}{'step deep/shallow':<33}"
             f"{'break-even p':<26}shallow's mean acceptance length there"]
    for t in table:
        r = t["step_ratio"]
        ci = f" ({r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})" if "ci95" in r else ""
        bci = f" ({p(t['break_even_p_ci95'][0])}-{p(t['break_even_p_ci95'][1])})" if t["break_even_p_ci95"] else ""
        shallow, deep = (f"{t[k]} ({d})" for k, d in zip(("shallow", "deep"), t["depths"]))
        ratio = f"{r['geomean']:.3f}{ci} n={r['pairs']}"
        be = f"{p(t['break_even_p'])}{bci}"
        length = t["break_even_length_shallow"]
        lines.append(f"{t['cell']:<14}{shallow:<22}{deep:<24}{ratio:<33}{be:<26}{'-' if length is None else f'{length:.2f}'}")
    return "\n".join(lines)


def render_model(check: list[dict], gb10: dict) -> str:
    lines = ["", "the step model, held out on this run (H100 corners fitted at depth 2 on recipe48 run6):",
             f"{'cell':<14}{'depths':<10}{'measured':<24}predicted"]
    for h in check:
        ci = " ({:.3f}-{:.3f})".format(*h["measured_ci95"]) if h["measured_ci95"] else ""
        measured = "{:.3f}".format(h["measured"]) + ci
        lines.append(f"{h['cell']:<14}{'{} -> {}'.format(*h['depths']):<10}{measured:<24}"
                     f"{h['predicted'][0]:.3f}-{h['predicted'][1]:.3f} (idle {h['idle_ms']} ms, {h['idle_from']})")
    lines += ["", f"a GB10 at 48 layers, an estimate ({gb10['corners']} corners, idle {gb10['idle_ms'][0]}-{gb10['idle_ms'][1]} ms):",
              f"{'c':<4}{'depths':<10}{'step deeper/shallower':<24}break-even p"]
    for r in gb10["rows"]:
        p = r["break_even_p"]
        lines.append(f"{r['concurrency']:<4}{'{} -> {}'.format(*r['depths']):<10}"
                     f"{'{:.3f}-{:.3f}'.format(*r['step_ratio']):<24}{'never' if p[0] is None else '{:.3f}-{:.3f}'.format(*p)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.decode.mtp_depth", description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", nargs="+", help="bench_recipe raw rows (raw48.jsonl)")
    ap.add_argument("--json", help="also write the table here")
    ap.add_argument("--model", action="store_true", help="add the step model's check on this run and its GB10 estimate")
    a = ap.parse_args(argv)
    rows = recipe_report.load_rows(a.raw)
    table = comparisons(rows)
    if not table:
        print("no two servers that differ only in their draft depth at a measured cell", file=sys.stderr)
        return 1
    print(render(table))
    out: dict | list = table
    if a.model:
        check, gb10 = h100_check(rows, table), gb10_table()
        print(render_model(check, gb10))
        out = {"measured": table, "model_check_h100": check, "model_gb10_estimate": gb10}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
