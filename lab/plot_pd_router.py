#!/usr/bin/env python3
"""Plot lab/bench_pd_router.py results: for every run and router worker count, what the router adds
to the tail (router p99 − direct p99, seconds) and the p99 ratio against the 1.1× target, grouped by
how the decode fake paced its stream (--tokens × --token-ms).

    .venv/bin/python -m lab.plot_pd_router benchmarks/pd-router/paced-2core/*.json -o p99.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def rows(paths: list[Path]) -> list[dict]:
    out = []
    for path in paths:
        doc = json.loads(path.read_text())
        setup = doc["setup"]
        # several worker counts: w1, w2, ...; one: the ratios at the top (its "workers" key is not a run)
        runs = {k: v for k, v in doc.items() if re.fullmatch(r"w\d+", k)} or {f"w{setup['workers'][0]}": doc}
        for key, r in runs.items():
            out.append({"file": path.name, "workers": int(key[1:]),
                        "pacing": f"{setup['tokens_per_stream']} tokens × {setup.get('token_ms') or 10.0:g} ms",
                        "excess_p99": r["router"]["p99"] - r["direct"]["p99"], "ratio_p99": r["ratio_p99"],
                        "direct_p99": r["direct"]["p99"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True, help="the PNG to write")
    ns = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = rows(ns.files)
    pacings = sorted({r["pacing"] for r in data}, key=lambda p: -min(r["direct_p99"] for r in data if r["pacing"] == p))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "excess_p99", "router p99 − direct p99 (s)"),
                           (axes[1], "ratio_p99", "router p99 / direct p99")):
        for i, pacing in enumerate(pacings):
            for w, marker, color in ((1, "o", "tab:blue"), (2, "s", "tab:orange"), (4, "^", "tab:green")):
                ys = [r[key] for r in data if r["pacing"] == pacing and r["workers"] == w]
                if ys:
                    xs = [i + (w - 1.5) * 0.15 + 0.02 * j for j in range(len(ys))]
                    ax.scatter(xs, ys, marker=marker, color=color, label=f"{w} worker{'s' * (w > 1)}" if i == 0 else None)
        ax.set_xticks(range(len(pacings)), [f"{p}\n(direct p99 ~{min(r['direct_p99'] for r in data if r['pacing'] == p):.2f} s)"
                                            for p in pacings])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.1, color="red", linestyle="--", linewidth=1, label="target 1.1×")
    axes[0].set_ylim(bottom=0)
    axes[1].legend(loc="upper left", fontsize=8)
    fig.suptitle("pd router, 200 clients × 5 rounds, decode fake paced (lab/bench_pd_router.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(ns.out, dpi=110)
    print(f"wrote {ns.out} ({len(data)} router runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
