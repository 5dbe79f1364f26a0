#!/usr/bin/env python3
"""Plot lab/bench_ple.py results: cold gather time per strategy and batch size, one panel per run.

Usage: python3 -m lab.plot_ple_bench OUT.png RESULT.json [RESULT.json ...]
Needs matplotlib (not a project dependency: `pip install matplotlib` in any venv).
"""

from __future__ import annotations

import json
import os
import sys

SIZES = [("decode48", "48 rows"), ("decode192", "192 rows"), ("prefill131k", "131,072 rows")]
SERIES = [("serial_ms", "serial (table[ids])", "#999999"), ("anchor_ms", "upstream pool (32 thr)", "#d95f02"),
          ("willneed_ms", "WILLNEED + gather", "#7570b3"), ("uring_ms", "buffered io_uring", "#66a61e"),
          ("direct_ms", "O_DIRECT + doorkeeper", "#e6ab02"), ("ours_ms", "ours (timed choice)", "#1b9e77"),
          ("disk_bound_ms", "disk bound (O_DIRECT, together)", "#000000")]


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_ple_bench: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 2
    out, paths = argv[0], argv[1:]
    runs = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.6), squeeze=False)
    for ax, run, path in zip(axes[0], runs, paths):
        m = run.get("machine", {})
        width = 0.12
        for i, (key, label, color) in enumerate(SERIES):
            xs, ys = [], []
            for j, (size, _) in enumerate(SIZES):
                v = run.get(size, {}).get(key)
                if v:
                    xs.append(j + (i - (len(SERIES) - 1) / 2) * width)
                    ys.append(v)
            bars = ax.bar(xs, ys, width, label=label, color=color)
            for b, y in zip(bars, ys):
                ax.text(b.get_x() + b.get_width() / 2, y * 1.08, f"{y:.3g}", ha="center", va="bottom",
                        fontsize=6, rotation=90)
        ax.set_yscale("log")
        ax.set_xticks(range(len(SIZES)), [s[1] for s in SIZES])
        ax.set_ylabel("cold gather, median ms (log)")
        ax.set_title(f"{m.get('cpus', '?')} cores, {m.get('gpu') or 'no GPU'}, {m.get('table_gib', '?')} GiB table\n"
                     f"{os.path.basename(path)}", fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out + ".tmp.png", dpi=120)
    os.replace(out + ".tmp.png", out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
