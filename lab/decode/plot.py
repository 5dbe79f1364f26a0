"""The report of raw rows (summary, ratios, paired verdicts, extrapolation) as JSON and a bar chart."""

from __future__ import annotations

import json
from pathlib import Path

from lab.decode import extrapolate, model, servers, stats


def plot_cmd(args) -> int:
    # each row tagged with its file: the pairs stay inside one run (two runs repeat the same keys)
    rows = [json.loads(line) | {"run": i} for i, f in enumerate(args.files) for line in open(f) if line.strip()]
    summ = stats.summarize(rows)
    pair = stats.paired(rows)
    report = {"summary": summ, "ratios_vs_stock": stats.ratios(summ), "paired_vs_stock": pair,
              "extrapolated": extrapolate.extrapolate(summ, bw_h200_gbs=args.bandwidth_gbs),
              f"vs_stock_L{model.LAYERS}": stats.at_layers(summ, pair)}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted(summ, key=lambda k: (k.split("/")[1:], servers.ALL_CONFIGS.index(k.split("/")[0]) if k.split("/")[0] in servers.ALL_CONFIGS else 9))
    levels = sorted({c for lab in summ.values() for c in lab})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(labels))
    for ax, metric, title in ((axes[0], "aggregate_tok_s", "decode tok/s, all streams"),
                              (axes[1], "per_stream_tok_s", "decode tok/s per stream")):
        for i, lab in enumerate(labels):
            xs = [j + i * width for j in range(len(levels))]
            ys = [(summ[lab].get(c) or {}).get(metric) or 0 for c in levels]
            bars = ax.bar(xs, ys, width, label=lab)
            if stats.stock_of(lab) in summ and lab != stats.stock_of(lab):
                for b, c in zip(bars, levels):
                    ref = (summ[stats.stock_of(lab)].get(c) or {}).get(metric)
                    if ref and b.get_height():
                        ax.annotate(f"{b.get_height() / ref:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(levels))])
        ax.set_xticklabels([f"c={c}" for c in levels])
        ax.set_title(title)
    fig.suptitle("decode, MTP=2, --load-format dummy (ratios vs stock)")
    # one legend under both panels: inside them it covered the tallest bars
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0
