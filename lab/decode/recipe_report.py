"""bench_recipe's raw rows read back: paired ratios with 95% intervals, the decode step split, the
plot, and the GB10 band from a report's measured step. Apart from the bench that ran the servers, so
a change here (a plot, a table) re-makes reports, not the record of what ran."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from lab.decode import model, stats

GOAL, FLOOR = 1.00, 0.95  # issue 33: the recipe >= 1.00x stock, the interval's lower end >= 0.95
H200_BANDWIDTH_GBS = 4296.6  # measured on the decode-h200 H200 (run5, run6: --bandwidth-gbs)


def load_rows(files: list[str]) -> list[dict]:
    """Every row of every raw file, each tagged with its file: the pairs stay inside one run (two
    runs repeat the same keys)."""
    return [json.loads(line) | {"run": i} for i, f in enumerate(files) for line in open(f) if line.strip()]


def cell(r: dict) -> str:
    return f"c={r['concurrency']} p={r['prompt_tokens']}"


def _cell_order(name: str) -> tuple[int, int]:
    return int(name.split("p=")[1]), int(name.split()[0][2:])


def pairs(rows: list[dict], ref: str, field: str = "per_stream_tok_s") -> dict:
    """{label: {cell: [ratio, ...]}}: `field` (per-stream tok/s; or TTFT) over `ref`'s at the same
    cell and repeat (repeat = cycle x REPEATS + round: the adjacent blocks of one cycle) and file."""
    tok = {(r["label"], cell(r), r["repeat"], r.get("run", 0)): r[field]
           for r in rows if r.get("per_stream_tok_s") and r.get(field) and "repeat" in r}
    out: dict = {}
    for (label, c, rep, run), v in tok.items():
        other = tok.get((ref, c, rep, run))
        if label != ref and other:
            out.setdefault(label, {}).setdefault(c, []).append(v / other)
    return out


def interval(ratios: list[float], resamples: int = 20_000, seed: int = 0) -> dict:
    """Geometric mean and its 95% bootstrap interval (none from one pair)."""
    import numpy as np

    logs = np.log(np.asarray(ratios))
    row = {"pairs": len(ratios), "geomean": round(math.exp(float(logs.mean())), 3)}
    if len(ratios) >= 2:
        lo, hi = (math.exp(q) for q in np.quantile(stats.boot_means(logs, resamples, seed), [0.025, 0.975]))
        row["ci95"] = [round(lo, 3), round(hi, 3)]
    return row


def verdict(ratios: list[float], resamples: int = 20_000, seed: int = 0) -> dict:
    """interval(); met: mean >= GOAL and lower end >= FLOOR; missed: the upper end under GOAL; else open."""
    row = interval(ratios, resamples, seed)
    if "ci95" not in row:
        return row | {"verdict": "open", "why": "one pair: no interval"}
    (lo, hi), g = row["ci95"], row["geomean"]
    row["verdict"] = "met" if g >= GOAL and lo >= FLOOR else "missed" if hi < GOAL else "open"
    return row


def _against(rows: list[dict], field: str, summarize, pooled: bool) -> dict:
    """{ref: {label: {cell: summarize(ratios)}}} for each reference; vs nvidia and vs default list
    only the recipe's variants (the ablations against the recipe they take one part out of)."""
    out: dict = {}
    for ref in ("stock", "nvidia", "default"):
        table = {}
        for label, by in sorted(pairs(rows, ref, field).items()):
            if ref != "stock" and label in ("stock", "nvidia"):
                continue
            table[label] = ({"pooled": summarize([x for v in by.values() for x in v])} if pooled else {}) | {
                c: summarize(v) for c, v in sorted(by.items())}
        out[ref] = table
    return out


def _medians(rows: list[dict], field: str, scale: float = 1.0) -> dict:
    med: dict = {}
    for r in rows:
        if r.get("per_stream_tok_s") and r.get(field):
            med.setdefault(r["label"], {}).setdefault(cell(r), []).append(r[field])
    return {lab: {c: round(scale * statistics.median(v), 1) for c, v in sorted(by.items())} for lab, by in med.items()}


def report(rows: list[dict]) -> dict:
    out: dict = {"goal": f"geomean >= {GOAL} and 95% lower end >= {FLOOR}"}
    out |= {f"vs_{ref}": t for ref, t in _against(rows, "per_stream_tok_s", verdict, pooled=True).items()}
    out["per_stream_tok_s_median"] = _medians(rows, "per_stream_tok_s")
    # time to first token (each request's median over its streams), paired the same way: config /
    # ref, lower is faster. At p=6144 it is the prefill of c long prompts; at p=64 mostly one step
    out["ttft_ms_median"] = _medians(rows, "ttft_s", 1000.0)
    out |= {f"ttft_vs_{ref}": t for ref, t in _against(rows, "ttft_s", interval, pooled=False).items()}
    out["boots"] = [{k: r.get(k) for k in ("label", "cycle", "boot_s", "gpu_mib")} for r in rows if r.get("event") == "booted"]
    out["step_ms"] = step_breakdown(rows)
    return out


def step_breakdown(rows: list[dict]) -> dict:
    """Per config and cell (medians over rounds): the decode step in ms as one stream sees it
    (1000 / (tok/s per stream / acceptance length): one step emits acceptance-length tokens), and
    where patch 1 ran, its host work per lookup (gather + stage + dedup, on the critical path
    between the step's ids and the next forward) and how long it blocked on the GPU for the ids.
    Random weights accept nothing (length 1.0): then a step is 1000 / tok/s."""
    cells: dict = {}
    for r in rows:
        if not r.get("per_stream_tok_s"):
            continue
        c = cells.setdefault(r["label"], {}).setdefault(cell(r), {"step": [], "host": [], "wait": [], "rows": []})
        c["step"].append(1000.0 * (r.get("mtp_acceptance_length") or 1.0) / r["per_stream_tok_s"])
        ple = r.get("ple")
        if ple:
            c["host"].append(ple["gather_ms_per_op"] + ple["stage_ms_per_op"] + ple["dedup_ms_per_op"])
            c["wait"].append(ple["gpu_wait_ms_per_op"])
            c["rows"].append(ple["rows_per_op"])
    med = lambda v: round(statistics.median(v), 3) if v else None  # noqa: E731
    return {lab: {c: {"step": med(v["step"]), "ple_host": med(v["host"]), "ple_gpu_wait": med(v["wait"]),
                      "ple_rows": med(v["rows"])} for c, v in sorted(by.items())}
            for lab, by in sorted(cells.items())}


def plot(rep: dict, rows: list[dict], order: list[str], out: str | Path) -> None:
    """Left: median tok/s per stream, per config and cell. Right: each config's paired ratio to the
    reference (stock, or default for an ablation-only run) with its 95% interval, the goal's 1.00
    and floor's 0.95 drawn across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = rep["per_stream_tok_s_median"]
    labels = [c for c in order if c in med]
    cellnames = sorted({c for by in med.values() for c in by}, key=_cell_order)
    ref = "stock" if "stock" in labels else "default"  # an ablation-only run has no stock: read it against default
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(1, len(labels))
    for i, lab in enumerate(labels):
        xs = [j + i * width for j in range(len(cellnames))]
        ax.bar(xs, [med[lab].get(c, 0) for c in cellnames], width, label=lab, color=f"C{i}")
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(cellnames))])
    ax.set_xticklabels(cellnames, fontsize=8)
    ax.set_ylabel("decode tok/s per stream (median)")
    ax.legend(fontsize=8, ncol=len(labels))
    others = [lab for lab in labels if lab != ref]
    rwidth = 0.8 / max(1, len(others))
    for i, lab in enumerate(others):
        vs = rep[f"vs_{ref}"].get(lab, {})
        for j, c in enumerate(["pooled", *cellnames]):
            v = vs.get(c)
            if not v:
                continue
            x = j + i * rwidth
            lo, hi = v.get("ci95", [v["geomean"], v["geomean"]])
            rx.errorbar([x], [v["geomean"]], yerr=[[v["geomean"] - lo], [hi - v["geomean"]]], fmt="o", capsize=3,
                        color=f"C{labels.index(lab)}", label=lab if j == 0 else None)
            rx.annotate(f"{v['geomean']:.3f}", (x, hi), ha="center", va="bottom", fontsize=6)
    rx.axhline(GOAL, color="black", lw=0.8)
    rx.axhline(FLOOR, color="grey", lw=0.8, ls="--")
    rx.set_xticks([j + rwidth * (len(others) - 1) / 2 for j in range(len(cellnames) + 1)])
    rx.set_xticklabels(["pooled", *cellnames], fontsize=8)
    rx.set_ylabel(f"per-stream tok/s / {ref}'s (paired geomean, 95% CI)")
    rx.legend(fontsize=8)
    # rows before the H100 fallback (2026-12-06) name no GPU: every one of them ran on an H200
    layers = sorted({r.get("layers", model.LAYERS) for r in rows if "layers" in r}) or [model.LAYERS]
    gpus = sorted({r.get("gpu") or "NVIDIA H200" for r in rows if r.get("event") == "booted"}) or ["NVIDIA H200"]
    fig.suptitle(f"{'/'.join(map(str, layers))} layers, NVFP4 experts, dummy weights, {', '.join(gpus)}: "
                 f"ratios vs {ref}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def gb10_bands(reports: list[str], bandwidth_gbs: float = H200_BANDWIDTH_GBS) -> dict:
    """One band per report: default's c=1 step at the shortest prompt (random weights: per step)."""
    from lab.decode.extrapolate import RECIPE_BYTES, gb10_band

    bands = []
    for f in reports:
        steps = json.loads(Path(f).read_text())["step_ms"].get("default", {})
        c1 = next((c for c in sorted(steps, key=_cell_order) if c.startswith("c=1 ")), None)
        if c1 is None:
            raise SystemExit(f"{f}: no c=1 step of the default server")
        bands.append({"report": f, "cell": c1, **gb10_band(steps[c1]["step"], RECIPE_BYTES, bandwidth_gbs)})
    lo = min(b["gb10_tok_s_per_step"][0] for b in bands)
    hi = max(b["gb10_tok_s_per_step"][1] for b in bands)
    return {"bands": bands, "gb10_tok_s_per_step": [lo, hi]}
