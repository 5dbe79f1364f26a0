"""The statistics of raw rows: medians per config and concurrency, ratios to stock, the paired
per-stream ratios with bootstrap intervals and a verdict against the goal, and the estimate at 48
layers from stock's line through the measured layer counts."""

from __future__ import annotations

import statistics

from lab.decode import model


def key(r: dict) -> str:
    """A row's series: its config, and the layer count when the row has one (`matrix`)."""
    return f"{r['label']}/L{r['layers']}" if r.get("layers") else r["label"]


def stock_of(series: str) -> str:
    return "stock" + (series[series.index("/"):] if "/" in series else "")


def summarize(rows: list[dict]) -> dict:
    """{series: {concurrency: {median aggregate/per-stream tok/s, acceptance}}}."""
    out: dict = {}
    for r in rows:
        if "aggregate_tok_s" not in r:
            continue
        out.setdefault(key(r), {}).setdefault(r["concurrency"], []).append(r)
    res = {}
    for lab, by in out.items():
        res[lab] = {}
        for c, rs in sorted(by.items()):
            acc = [r["mtp_acceptance_length"] for r in rs if r.get("mtp_acceptance_length")]
            per = [r["per_stream_tok_s"] for r in rs if r.get("per_stream_tok_s")]
            res[lab][c] = {"aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in rs),
                           "per_stream_tok_s": statistics.median(per) if per else None,
                           "acceptance_length": statistics.median(acc) if acc else None, "n": len(rs)}
            ple = [r["ple"] for r in rs if r.get("ple")]
            if ple:  # patch 1's lookups at this level alone (the server's stats line mixes the levels)
                res[lab][c]["ple"] = {k: round(statistics.median(p[k] for p in ple), 4)
                                      for k in ple[0] if k != "ops"} | {"n": len(ple)}
    return res


def ratios(summ: dict) -> dict:
    """{series: {concurrency: per-stream and aggregate tok/s as a ratio of stock's at the same layer count}}."""
    out: dict = {}
    for series, by in summ.items():
        ref = summ.get(stock_of(series))
        if not ref or series == stock_of(series):
            continue
        for c, v in by.items():
            r = ref.get(c) or {}
            out.setdefault(series, {})[c] = {
                k: round(v[k] / r[k], 3) for k in ("aggregate_tok_s", "per_stream_tok_s") if v.get(k) and r.get(k)}
    return out

GOAL_VS_STOCK = 0.90  # issue 12: FULL + hoisted within 10% of the stock ceiling


def fit_line(xy: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through points at two or more distinct x."""
    n = len(xy)
    mx, my = sum(x for x, _ in xy) / n, sum(y for _, y in xy) / n
    b = sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)
    return my - b * mx, b


def boot_means(xs, resamples: int, seed: int):
    """The means of `resamples` bootstrap resamples of `xs` (numpy, fixed seed: the same rows give
    the same interval)."""
    import numpy as np

    return xs[np.random.default_rng(seed).integers(0, len(xs), (resamples, len(xs)))].mean(axis=1)


def verdict(logs, goal: float, resamples: int, seed: int) -> dict:
    """Log ratios -> geometric mean, 95% bootstrap interval (numpy, fixed seed: the same rows give
    the same interval) and a verdict against `goal`: met when the interval lies above it, missed
    when below, else open, with the pairs an interval that narrow would need at this spread (normal
    approximation)."""
    import math

    import numpy as np

    g = math.exp(float(np.mean(logs)))
    row = {"pairs": len(logs), "geomean": round(g, 3)}
    if len(logs) < 2:
        return row | {"verdict": "open", "why": "one pair: no interval"}
    lo, hi = (math.exp(q) for q in np.quantile(boot_means(logs, resamples, seed), [0.025, 0.975]))
    row["ci95"] = [round(lo, 3), round(hi, 3)]
    if lo >= goal:
        row["verdict"] = "met"
    elif hi < goal:
        row["verdict"] = "missed"
    else:
        row["verdict"] = "open"
        if g > goal:  # pairs for the interval's lower end to clear the goal if the mean stayed
            row["pairs_needed"] = math.ceil((1.96 * float(np.std(logs, ddof=1)) / math.log(g / goal)) ** 2)
    return row


def paired(rows: list[dict], goal: float = GOAL_VS_STOCK, resamples: int = 20_000, seed: int = 0) -> dict:
    """Each config against stock, pair by pair: the same layer count, concurrency and repeat (the
    matrix measures the servers back to back, so a pair shares one window of the machine's noise).
    Pooled over the pairs: `verdict` (geometric mean of the per-stream ratios, 95% bootstrap
    interval, met/missed/open against `goal`), median and range; and the same verdict per
    concurrency (`per_concurrency`): a pooled mean can sit on the goal while one level misses it."""
    import math

    import numpy as np

    tok: dict = {}
    for r in rows:
        if r.get("per_stream_tok_s"):  # `run`: which file a row came from (plot's), so no pair spans two runs
            tok[(r["label"], r.get("layers"), r["concurrency"], r.get("repeat"), r.get("run", 0))] = r["per_stream_tok_s"]
    out: dict = {}
    for label in sorted({k[0] for k in tok} - {"stock"}):
        keys = sorted((k for k in tok if k[0] == label and ("stock", *k[1:]) in tok), key=lambda k: tuple(map(str, k)))
        logs = np.log([tok[k] / tok[("stock", *k[1:])] for k in keys])
        if not len(logs):
            continue
        levels = sorted({k[2] for k in keys})
        mask = {c: np.array([k[2] == c for k in keys]) for c in levels}
        at = {c: logs[mask[c]] for c in levels}
        # ms per stream and step (acceptance 1) the config adds to stock's, pair by pair
        added = np.array([1000.0 / tok[k] - 1000.0 / tok[("stock", *k[1:])] for k in keys])
        row = {"pairs": len(logs), "geomean": round(math.exp(logs.mean()), 3),
               "median": round(math.exp(float(np.median(logs))), 3),
               "min": round(math.exp(logs.min()), 3), "max": round(math.exp(logs.max()), 3), "goal": goal,
               "by_concurrency": {c: round(math.exp(float(at[c].mean())), 3) for c in levels}}
        row |= {k: v for k, v in verdict(logs, goal, resamples, seed).items() if k not in row}
        row["per_concurrency"] = {c: verdict(at[c], goal, resamples, seed)
                                  | {"added_ms": mean_ci(added[mask[c]], resamples, seed)} for c in levels}
        out[label] = row
    return out


def mean_ci(xs, resamples: int, seed: int) -> dict:
    """Mean and 95% bootstrap interval (fixed seed), rounded to µs."""
    import numpy as np

    row = {"mean": round(float(np.mean(xs)), 3)}
    if len(xs) > 1:
        row["ci95"] = [round(float(q), 3) for q in np.quantile(boot_means(xs, resamples, seed), [0.025, 0.975])]
    return row


def at_layers(summ: dict, pair: dict, layers: int = model.LAYERS) -> dict:
    """An estimate, per concurrency, of each config against stock at `layers`: stock's ms per step
    read off its line through the measured layer counts (per-stream medians), plus the ms the config
    adds per step (`paired`'s `added_ms`) taken as layer-independent: right for the hoisted gather
    (one PLE layer, one hook per step, whatever the layer count), wrong for eager (PIECEWISE leaves
    the graph at every attention layer). Ratio = stock / (stock + added), with the added ms's interval."""
    pts: dict = {}
    for series, by in summ.items():
        cfg, _, L = series.partition("/L")
        if cfg == "stock" and L.isdigit():
            for c, v in by.items():
                if v.get("per_stream_tok_s"):
                    pts.setdefault(c, []).append((int(L), 1000.0 / v["per_stream_tok_s"]))
    stock, floors = {}, {}
    for c, xy in sorted(pts.items()):
        if len({x for x, _ in xy}) < 2:
            continue
        a, b = fit_line(xy)
        if b > 0:
            stock[c] = a + b * layers
        else:  # a step cannot shrink with more layers: the cells' noise made this line
            floors[c] = f"stock's line at c={c} falls with the layers (slope {b:.3f} ms per layer): noise"
    if stock:
        # a level without a rising line of its own: the lowest level's line is a floor (a step at a
        # higher concurrency is not shorter), so its ratio is a lower bound
        low = min(stock)
        for c in sorted(set(pts) - {low}):
            if c in floors:
                floors[c] += f"; c={low}'s line used as a floor: the ratio is a lower bound"
            elif c in stock and stock[c] < stock[low]:
                floors[c] = (f"stock's line at c={c} reads {stock[c]:.2f} ms, under c={low}'s: noise; "
                             f"c={low}'s used as a floor: the ratio is a lower bound")
            else:
                continue
            stock[c] = stock[low]
    out: dict = {"note": f"estimate: stock's line at {layers} layers + the measured added ms per step, taken as "
                         "layer-independent (one PLE layer: true of the hoisted gather, not of eager)",
                 f"stock_ms_L{layers}": {c: round(v, 3) for c, v in sorted(stock.items())}}
    if floors:
        out["floors"] = floors
    if not stock:
        return out | {"why": "no rising stock line through two layer counts at any level"}
    for label, row in pair.items():
        if label == "eager":
            continue
        per = {}
        for c, v in (row.get("per_concurrency") or {}).items():
            if c in stock and "added_ms" in v:
                s, add = stock[c], v["added_ms"]
                per[c] = {"ratio": round(s / (s + add["mean"]), 3)} | ({"bound": "lower"} if c in floors else {})
                if "ci95" in add:
                    per[c]["range"] = [round(s / (s + add["ci95"][1]), 3), round(s / (s + add["ci95"][0]), 3)]
        out[label] = per
    return out
