"""`flash bench`: decode at several concurrencies, prefill at several sizes, TTFT cold and on a
prefix hit; every point repeated, reported as median and spread; two servers are measured in
ABBA order so drift (thermals, page cache) falls on both alike. Raw JSONL + summary + PNGs.

With MTP on, each decode point also records the acceptance length (1 + accepted / drafts) and the
per-position acceptance rates from the server's own counters (`vllm:spec_decode_*` on /metrics,
read before and after the point): the tokens per step that decode tok/s depends on, so two
servers (e.g. DRAFT_VOCAB=0 vs 1) are compared on both. The deltas are the server's whole traffic
during the point: they are exact only while the bench is its only client.

The plan is plain data (`plan()`), the runner executes it point by point, and `summarize()`
and `plot()` read only the raw records, so a results folder can be re-plotted later.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from . import prompts as P
from .client import Client
from .spec_decode import acceptance, settled_spec_counters, spec_counters

DECODE_PROMPTS = (
    "Explain in about 200 words how a CPU cache hierarchy works. /no_think",
    "Describe in about 200 words how a B-tree index speeds up database lookups. /no_think",
    "Explain in about 200 words what a page fault is and what it costs. /no_think",
    "Describe in about 200 words how TCP congestion control reacts to packet loss. /no_think",
    "Explain in about 200 words how garbage collection works in a generational collector. /no_think",
    "Describe in about 200 words how a compiler performs register allocation. /no_think",
    "Explain in about 200 words how public-key cryptography lets strangers agree on a secret. /no_think",
    "Describe in about 200 words how a hash table handles collisions. /no_think",
)


@dataclass(frozen=True)
class Point:
    """One measurement to take: kind (decode | prefill), its parameter, repeat index, target."""

    kind: str
    param: int  # concurrency for decode, prompt tokens for prefill
    repeat: int
    target: str  # label


@dataclass
class Target:
    label: str
    url: str
    key: str | None = None
    model: str = ""


def parse_levels(text: str, what: str) -> list[int]:
    from ..errors import UsageError

    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(v < 1 for v in levels):
        raise UsageError(f"{what}={text!r}: expected positive integers separated by commas, e.g. 1,2,4,8")
    return levels


def plan(labels: list[str], concurrency: list[int], prefill: list[int], repeats: int) -> list[Point]:
    """Every point, in run order. With two targets each (kind, param, repeat) runs A,B on even
    repeats and B,A on odd ones: A B B A A B … (ABBA)."""
    points = []
    for kind, params in (("decode", concurrency), ("prefill", prefill)):
        for param in params:
            for r in range(repeats):
                order = labels if r % 2 == 0 else list(reversed(labels))
                points += [Point(kind, param, r, lab) for lab in order]
    return points


def read_prompts(path: Path) -> tuple[str, ...]:
    """`--prompts FILE`: one prompt per line; blank lines and `#` lines skipped."""
    from ..errors import UsageError

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts {path}: cannot read it as UTF-8 text ({exc})",
                         hint="a text file with one prompt per line") from None
    prompts = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not prompts:
        raise UsageError(f"--prompts {path}: no prompts in it", hint="one prompt per line; # starts a comment")
    return prompts


def prompts_source(path: Path | None, prompts: tuple[str, ...]) -> dict:
    """What meta.json records about the decode prompts: enough to tell two runs' apart."""
    import hashlib

    digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()
    return {"file": str(path) if path else None, "count": len(prompts), "sha256": digest}


def _decode(client: Client, model: str, conc: int, max_tokens: int, salt: str,
            prompts: tuple[str, ...] = DECODE_PROMPTS) -> dict:
    """`conc` streams at once, each a real answer to a distinct prompt (no shared prefix beyond
    the chat template, so no prefix-cache help). Aggregate = all tokens / wall time."""
    out: list = [None] * conc
    barrier = threading.Barrier(conc)

    def one(i: int) -> None:
        prompt = f"[{salt}-{i}] " + prompts[i % len(prompts)]
        barrier.wait()
        out[i] = client.stream("/v1/chat/completions", {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                                        "messages": [{"role": "user", "content": prompt}]})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [s.error or f"HTTP {s.status}" for s in out if s.status != 200 or s.error]
    if errors:
        return {"error": errors[0]}
    start, end = min(s.sent for s in out), max(s.end for s in out)
    tokens = sum(s.completion_tokens for s in out)
    per_stream = [(s.completion_tokens - 1) / (s.end - s.first) for s in out if s.first and s.end > s.first and s.completion_tokens > 1]
    return {"aggregate_tok_s": tokens / (end - start), "per_stream_tok_s": statistics.median(per_stream) if per_stream else None,
            "tokens": tokens, "wall_s": end - start, "ttft_s": statistics.median([s.ttft for s in out if s.ttft is not None])}


def _prefill(client: Client, model: str, size: int) -> dict:
    """A cold prompt (fresh nonce first), then the same prompt again: TTFT cold and on a hit."""
    prompt = P.ledger_prompt(size, nonce=uuid.uuid4().hex[:12])
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    cold = client.stream("/v1/completions", body)
    hit = client.stream("/v1/completions", body)
    for s in (cold, hit):
        if s.status != 200 or s.error or s.ttft is None:
            return {"error": s.error or f"HTTP {s.status}"}
    n = int(cold.usage.get("prompt_tokens") or 0)
    return {"prompt_tokens": n, "ttft_cold_s": cold.ttft, "ttft_hit_s": hit.ttft,
            "prefill_tok_s": n / cold.ttft if cold.ttft else None,
            "cached_tokens": int((hit.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)}


def run(targets: list[Target], points: list[Point], max_tokens: int, timeout: float, sink: Callable[[dict], None],
        progress: bool = False, prompts: tuple[str, ...] = DECODE_PROMPTS) -> list[dict]:
    clients = {t.label: (Client(t.url, t.key, timeout), t.model) for t in targets}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(points), unit="pt", file=sys.stderr, dynamic_ncols=True)
    records = []
    try:
        for p in points:
            client, model = clients[p.target]
            if bar:
                bar.set_description(f"{p.target} {p.kind} {p.param}")
            started = time.time()
            if p.kind == "decode":
                before = spec_counters(client)
                values = _decode(client, model, p.param, max_tokens, uuid.uuid4().hex[:8], prompts)
                if before is not None and "error" not in values:
                    values.update(acceptance(before, settled_spec_counters(client, before)))
            else:
                values = _prefill(client, model, p.param)
            rec = {**asdict(p), "started": round(started, 3), **values}
            records.append(rec)
            sink(rec)
            if bar:
                bar.update(1)
    finally:
        if bar:
            bar.close()
    return records


# --- summary ------------------------------------------------------------------------------------
METRICS = {"decode": ("aggregate_tok_s", "per_stream_tok_s", "ttft_s", "mtp_acceptance_length"),
           "prefill": ("prefill_tok_s", "ttft_cold_s", "ttft_hit_s")}


def _stats(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "min": values[0], "max": values[-1],
            "spread_pct": 100.0 * (values[-1] - values[0]) / statistics.median(values) if statistics.median(values) else None}


def summarize(records: list[dict]) -> dict:
    """{target: {kind: {param: {metric: stats}}}} plus B/A ratios of medians when two targets."""
    out: dict = {}
    labels: list[str] = []
    for r in records:
        if r["target"] not in labels:
            labels.append(r["target"])
    for lab in labels:
        for kind, metrics in METRICS.items():
            rows = [r for r in records if r["target"] == lab and r["kind"] == kind and "error" not in r]
            for param in sorted({r["param"] for r in rows}):
                sel = [r for r in rows if r["param"] == param]
                out.setdefault(lab, {}).setdefault(kind, {})[str(param)] = {m: _stats([r.get(m) for r in sel]) for m in metrics}
    errors = [r for r in records if "error" in r]
    summary = {"targets": labels, "results": out, "errors": len(errors)}
    if len(labels) == 2:
        a, b = labels
        ratios: dict = {}
        for kind, metrics in METRICS.items():
            for param, stats in out.get(a, {}).get(kind, {}).items():
                other = out.get(b, {}).get(kind, {}).get(param)
                if not other:
                    continue
                for m in metrics:
                    ma, mb = stats[m].get("median"), other[m].get("median")
                    if ma and mb:
                        ratios.setdefault(kind, {}).setdefault(param, {})[m] = mb / ma
        summary["ratio_b_over_a"] = {"a": a, "b": b, **ratios}
    return summary


def table(summary: dict) -> list[str]:
    """Human lines: median [min–max] per point and target."""
    lines = []
    for lab in summary["targets"]:
        res = summary["results"].get(lab, {})
        for param, st in res.get("decode", {}).items():
            agg, per = st["aggregate_tok_s"], st["per_stream_tok_s"]
            acc = st.get("mtp_acceptance_length", {})
            mtp = (f", MTP acceptance length {acc['median']:.2f} [{acc['min']:.2f}–{acc['max']:.2f}]"
                   if acc.get("n") else "")
            lines.append(f"{lab:<10} decode  c={param:<4} {agg.get('median', 0):8.1f} tok/s aggregate "
                         f"[{agg.get('min', 0):.1f}–{agg.get('max', 0):.1f}], per stream {per.get('median') or 0:.1f}"
                         f"{mtp}  (n={agg['n']})")
        for param, st in res.get("prefill", {}).items():
            pf, tc, th = st["prefill_tok_s"], st["ttft_cold_s"], st["ttft_hit_s"]
            lines.append(f"{lab:<10} prefill {int(param):>6} tok {pf.get('median', 0):8.0f} tok/s "
                         f"[{pf.get('min', 0):.0f}–{pf.get('max', 0):.0f}]; TTFT cold {tc.get('median', 0):.3f} s, "
                         f"on prefix hit {th.get('median', 0):.3f} s  (n={pf['n']})")
    ratios = summary.get("ratio_b_over_a")
    if ratios:
        for kind, metric in (("decode", "aggregate_tok_s"), ("decode", "mtp_acceptance_length"),
                             ("prefill", "prefill_tok_s")):
            for param, rs in ratios.get(kind, {}).items():
                if metric in rs:
                    lines.append(f"{ratios['b']}/{ratios['a']} {kind} {param}: {rs[metric]:.3f}x {metric}")
    return lines


# --- files ----------------------------------------------------------------------------------------
def machine() -> dict:
    info = {"host": platform.node(), "system": platform.platform(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/meminfo") as fh:
            info["mem_total_kib"] = int(next(l for l in fh if l.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration):
        pass
    return info


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def plot(records: list[dict], outdir: Path) -> list[Path]:
    """PNGs from the raw records: median with min–max error bars, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(records)
    written = []
    specs = (
        ("decode", "aggregate_tok_s", "concurrency", "decode tok/s (all streams)", "decode_aggregate.png"),
        ("decode", "per_stream_tok_s", "concurrency", "decode tok/s per stream", "decode_per_stream.png"),
        ("decode", "mtp_acceptance_length", "concurrency", "MTP acceptance length", "decode_acceptance.png"),
        ("prefill", "prefill_tok_s", "prompt tokens", "prefill tok/s (cold)", "prefill.png"),
    )
    for kind, metric, xlabel, ylabel, name in specs:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        drawn = False
        for lab in summary["targets"]:
            pts = summary["results"].get(lab, {}).get(kind, {})
            xs = sorted(int(k) for k in pts if pts[k][metric].get("n"))
            if not xs:
                continue
            med = [pts[str(x)][metric]["median"] for x in xs]
            lo = [m - pts[str(x)][metric]["min"] for x, m in zip(xs, med)]
            hi = [pts[str(x)][metric]["max"] - m for x, m in zip(xs, med)]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=lab)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.set_title(f"{ylabel}: median, bars = min–max")
        fig.tight_layout()
        path = outdir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    # TTFT cold vs hit, grouped bars per prompt size
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    labels = summary["targets"]
    sizes = sorted({int(k) for lab in labels for k in summary["results"].get(lab, {}).get("prefill", {})})
    if sizes:
        width = 0.8 / (2 * len(labels))
        for j, lab in enumerate(labels):
            pts = summary["results"].get(lab, {}).get("prefill", {})
            for k, (metric, tag) in enumerate((("ttft_cold_s", "cold"), ("ttft_hit_s", "prefix hit"))):
                ys = [pts.get(str(s), {}).get(metric, {}).get("median") or 0 for s in sizes]
                xs = [i + (2 * j + k) * width for i in range(len(sizes))]
                ax.bar(xs, ys, width, label=f"{lab} {tag}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [f"{s:,}" for s in sizes])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s, median)")
        ax.set_title("time to first token: cold vs prefix hit")
        ax.legend()
        fig.tight_layout()
        path = outdir / "ttft.png"
        fig.savefig(path)
        written.append(path)
    plt.close(fig)
    return written
