#!/usr/bin/env python3
"""What a user feels at the full 48-layer shape (issue 33, item 2), stock vLLM against the recipe:

- prefix: a shared prefix of 1k-16k tokens sent three times, each with a tail of its own (32 tokens:
  a question after a shared document; 2,000: a user's own document after a shared system prompt).
  Each prompt's prefix-cache hit tokens (vLLM's own counters, read around it) and time to first
  token. Users report no hits under ~8k tokens in the Mamba "align" mode; the goal is hits from 2k
  tokens on. vLLM's own scheduler, run on CPU (tests/vllm/release/prefix_sim.py, docs/PREFIX-CACHE.md),
  predicts where they land: with a 2,000-token tail the second prompt misses under vLLM's default
  retention and the third hits, so the second and third are reported apart.
- itl: one stream decoding while another client sends a 32k-token prefill, against a stream alone.
  The stream keeps decoding until the prompt's first token has come (since 2026-12-07: before, it
  stopped at 384 tokens and a prompt still running went on alone, in whole steps). Inter-token gaps
  are measured client-side from the streamed chunks (one chunk per step, more than one token per
  chunk when MTP accepts). The goal: p99 with `shared` <= 2x its idle p99.

Servers are bench_recipe's (the RunSpec `flash serve` renders, same substitutions, same model
directory from `python3 -m lab.bench_recipe prepare`), run one at a time in blocks.

  run DIR --out RAW.jsonl [--configs stock,default,default-dense,shared] [--prefixes 1024,2048,…]
      [--tails 32,2000] [--repeats N] [--set KEY=VALUE …] [--itl-only CONFIGS]
  report RAW.jsonl… [--json J] [--png P]   per config: hits and TTFT by prefix length; ITL idle vs under prefill
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from lab import bench_recipe as br  # the servers
from lab.decode import client, recipe_report  # the metrics reader, the writer; the raw-file reader

PREFIXES = (1024, 2048, 4096, 8192, 16384)
TAILS = (32, 2000)   # distinct tokens after the shared prefix: a question; a document of its own
SENDS = 3            # prompts per shared prefix: the first fills the cache, the second and third may hit
PREFILL = 32768      # the other client's prompt in the ITL study
ITL_TOKENS = 384     # the idle stream's length; the prefill starts after ITL_LEAD chunks of the busy one
ITL_LEAD = 32        # ... and the busy stream is closed ITL_LEAD chunks after the prefill's first token
# The busy stream decodes until then, at most this many tokens. vLLM 0.31+ cuts a long prompt into
# LONG_PREFILL pieces only while another request is running (v1 scheduler: the threshold is 0 for a
# lone request), so a stream that ended first left the prompt's rest to whole steps (latency48 run4)
ITL_CAP = 16384
HITS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")
HIT_GOAL_FROM = 2048   # prefix tokens from which the recipe should hit
ITL_GOAL = 2.0         # p99 under prefill / idle p99, for `shared`


def ids(rng: random.Random, n: int) -> list[int]:
    """n random token ids: past the special ids, inside the vocabulary (bench_profile's prompts too)."""
    return [rng.randrange(1000, 240000) for _ in range(n)]


def _counters(url: str) -> dict[str, float]:
    """The prefix-cache counters, summed over labels (the `_total` spelling or the bare one)."""
    got = client.read_counters(url, tuple(f"{n}_total" for n in HITS) + HITS)
    return {n: got.get(f"{n}_total", got.get(n, 0.0)) or 0.0 for n in HITS}


def stream(url: str, prompt: list[int], tokens: int, stamps: list[float] | None = None, stop=None) -> dict:
    """One streamed greedy completion: time to first chunk, every chunk's arrival (into `stamps`).
    `stop()` true after a chunk closes the stream there (vLLM aborts a request whose client left)."""
    import requests

    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    stamps = stamps if stamps is not None else []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for chunk in client.sse_chunks(r):
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first if first is not None else now
                stamps.append(now)
                if stop is not None and stop():
                    break
    if first is None:
        raise RuntimeError("the stream carried no tokens")
    return {"ttft_s": first - t0, "wall_s": time.perf_counter() - t0, "chunks": len(stamps)}


def prefix_rows(url: str, label: str, prefixes: list[int], repeats: int, base: dict, seed: int = 0,
                tails: tuple[int, ...] = TAILS) -> list[dict]:
    """One row per prompt: SENDS prompts per (repeat, tail, prefix length), the same prefix, each
    with a tail of its own; `send` 1 is cold (a fresh prefix), 2 and 3 are what a cache can serve."""
    rows = []
    for rep in range(repeats):
        for tail in tails:
            for n in prefixes:
                rng = random.Random(seed * 1_000_003 + rep * 100_003 + tail * 1_009 + n)  # a fresh prefix each
                prefix = ids(rng, n)
                for send in range(1, SENDS + 1):
                    before = _counters(url)
                    got = stream(url, prefix + ids(rng, tail), 1)
                    after = _counters(url)
                    rows.append({**base, "label": label, "study": "prefix", "prefix_tokens": n, "tail_tokens": tail,
                                 "repeat": rep, "send": send, "ttft_s": got["ttft_s"],
                                 "hit_tokens": after[HITS[0]] - before[HITS[0]],
                                 "query_tokens": after[HITS[1]] - before[HITS[1]]})
    return rows


def gaps_ms(stamps: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def itl_rows(url: str, label: str, repeats: int, base: dict, prefill: int = PREFILL, tokens: int = ITL_TOKENS) -> list[dict]:
    """Per repeat: a stream of `tokens` alone, then a stream with a `prefill`-token prompt sent once
    ITL_LEAD chunks have arrived, kept decoding until ITL_LEAD chunks after the prompt's first token
    (at most ITL_CAP tokens); the gaps counted are those while the prefill was in flight."""
    cap = max(tokens, ITL_CAP)
    rows = []
    rng = random.Random(99)
    for rep in range(repeats):
        idle: list[float] = []
        stream(url, ids(rng, 64), tokens, idle)
        busy: list[float] = []
        window: dict = {}

        def other(stamps=busy):
            while len(stamps) < ITL_LEAD:
                time.sleep(0.001)
            window["start"] = time.perf_counter()
            window["ttft_s"] = stream(url, ids(rng, prefill), 1)["ttft_s"]
            window["end"] = time.perf_counter()
            window["chunks"] = len(stamps)

        def after_prefill(stamps=busy):
            return "chunks" in window and len(stamps) >= window["chunks"] + ITL_LEAD

        t = threading.Thread(target=other)
        t.start()
        stream(url, ids(rng, 64), cap, busy, stop=after_prefill)
        t.join()
        if "end" not in window:
            raise RuntimeError("the prefill did not finish")
        inside = [g for (a, b), g in zip(zip(busy, busy[1:]), gaps_ms(busy))
                  if b >= window["start"] and a <= window["end"]]
        ig = gaps_ms(idle)
        rows.append({**base, "label": label, "study": "itl", "repeat": rep, "prefill_tokens": prefill,
                     "prefill_ttft_s": window["ttft_s"], "idle_p50_ms": pct(ig, 0.5), "idle_p99_ms": pct(ig, 0.99),
                     "busy_gaps": len(inside), "busy_sum_ms": sum(inside),
                     "busy_p50_ms": pct(inside, 0.5) if inside else None,
                     "busy_p99_ms": pct(inside, 0.99) if inside else None, "busy_max_ms": max(inside, default=None),
                     "stream_finished_after_prefill": busy[-1] > window["end"]})
    return rows


def run(args) -> int:
    d = Path(args.dir).resolve()
    meta = json.loads((d / "meta.json").read_text())
    configs = br._configs(args.configs)
    itl_only = set(br._configs(args.itl_only)) if args.itl_only else set()
    if itl_only - set(configs):
        raise SystemExit(f"--itl-only {','.join(sorted(itl_only - set(configs)))}: not in --configs {args.configs}")
    prefixes = client.parse_levels(args.prefixes)
    tails = tuple(client.parse_levels(args.tails))
    sink = client.jsonl_sink(args.out)
    logs = Path(args.logs or Path(args.out).parent)
    logs.mkdir(parents=True, exist_ok=True)
    specs = br.render_all(configs, d, args.port, args.set)
    base = br.row_base(meta)
    with br.exit_on_term():
        for name in configs:
            with br.serving(specs[name], logs / f"latency-{name}.log", args.boot_timeout,
                            lambda row: sink({**base, **row, "label": name})) as srv:
                if srv is None:
                    continue
                stream(srv.url, ids(random.Random(5), 64), 8)  # untimed: the first request's one-time costs
                if name not in itl_only:
                    for row in prefix_rows(srv.url, name, prefixes, args.repeats, base, tails=tails):
                        sink(row)
                for row in itl_rows(srv.url, name, args.repeats, base, args.prefill, args.itl_tokens):
                    sink(row)
    return 0


def report(rows: list[dict]) -> dict:
    """Per config: per tail and prefix length, the median hit tokens and TTFT of each send; where hits
    start (on the second send and on the third); ITL idle vs under the other client's prefill."""
    cells: dict = {}
    itl: dict = {}
    for r in rows:
        if r.get("study") == "prefix":
            key = (r["label"], r["tail_tokens"], r["prefix_tokens"], r["send"])
            cells.setdefault(key, []).append(r)
        elif r.get("study") == "itl":
            itl.setdefault(r["label"], []).append(r)
    summary: dict = {}
    for (label, tail, n, send), cell in sorted(cells.items()):
        by_n = summary.setdefault(label, {}).setdefault("prefix", {}).setdefault(str(tail), {}).setdefault(str(n), {})
        by_n[f"send{send}"] = {"repeats": len(cell), "hit_tokens": statistics.median(c["hit_tokens"] for c in cell),
                               "ttft_ms": round(statistics.median(c["ttft_s"] for c in cell) * 1000, 1)}
    for label, s in summary.items():
        for tail, by_n in s.get("prefix", {}).items():
            for send in range(2, SENDS + 1):
                hit = [int(n) for n, c in by_n.items() if c.get(f"send{send}", {}).get("hit_tokens", 0) >= int(n) / 2]
                s.setdefault("hits_from_tokens", {}).setdefault(tail, {})[f"send{send}"] = min(hit) if hit else None
        # the goal: at least half the prefix served from the cache from 2k tokens on, by the third send
        s["hit_goal_met"] = bool(s.get("prefix")) and all(
            c.get(f"send{SENDS}", {}).get("hit_tokens", 0) >= int(n) / 2
            for by_n in s["prefix"].values() for n, c in by_n.items() if int(n) >= HIT_GOAL_FROM)
    for label, rs in itl.items():
        s = summary.setdefault(label, {})
        idle = statistics.median(r["idle_p99_ms"] for r in rs)
        busy = [r["busy_p99_ms"] for r in rs if r["busy_p99_ms"] is not None]
        s["itl"] = {"repeats": len(rs), "idle_p50_ms": round(statistics.median(r["idle_p50_ms"] for r in rs), 2),
                    "idle_p99_ms": round(idle, 2),
                    "busy_p50_ms": round(statistics.median(r["busy_p50_ms"] for r in rs if r["busy_p50_ms"] is not None), 2)
                    if busy else None,
                    "busy_gaps": statistics.median(r["busy_gaps"] for r in rs),
                    "busy_p99_ms": round(statistics.median(busy), 2) if busy else None,
                    "p99_ratio": round(statistics.median(busy) / idle, 2) if busy and idle else None,
                    "prefill_ttft_s": round(statistics.median(r["prefill_ttft_s"] for r in rs), 2)}
        s["itl"]["goal_met"] = s["itl"]["p99_ratio"] is not None and s["itl"]["p99_ratio"] <= ITL_GOAL
    return summary


def plot(summary: dict, rows: list[dict], out: str | Path) -> None:
    """Left, one panel per tail: TTFT against the shared prefix's length, the first prompt (cold,
    dashed) and the third (what the cache served, solid), per config, log-log. Right: the decoding
    stream's p99 gap alone and under the other client's prefill, per config, with the goal's 2x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(summary)
    tails = sorted({t for s in summary.values() for t in s.get("prefix", {})}, key=int)
    # squeeze=False: an --itl-only run has no prefix panel, and one Axes is not a sequence
    fig, axes = plt.subplots(1, len(tails) + 1, figsize=(5 * (len(tails) + 1), 4.4), squeeze=False)
    axes = axes[0]
    for ax, tail in zip(axes, tails):
        for i, label in enumerate(labels):
            by_n = summary[label].get("prefix", {}).get(tail, {})
            ns = sorted(by_n, key=int)
            for send, ls in ((1, "--"), (SENDS, "-")):
                ys = [by_n[n].get(f"send{send}", {}).get("ttft_ms") for n in ns]
                ax.plot([int(n) for n in ns], ys, ls, marker="o", color=f"C{i}", label=f"{label} #{send}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("shared prefix tokens")
        ax.set_ylabel("TTFT, median (ms)")
        ax.set_title(f"tail of {tail} tokens: prompt #1 (cold) vs #{SENDS}", fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[-1]
    itl = [lb for lb in labels if "itl" in summary[lb]]
    for i, label in enumerate(itl):
        s = summary[label]["itl"]
        ax.bar([i - 0.2], [s["idle_p99_ms"]], 0.4, color=f"C{labels.index(label)}", alpha=0.45,
               label="alone" if i == 0 else None)
        ax.bar([i + 0.2], [s["busy_p99_ms"] or 0], 0.4, color=f"C{labels.index(label)}",
               label=f"under a {PREFILL}-token prefill" if i == 0 else None)
        ax.plot([i - 0.4, i + 0.4], [ITL_GOAL * s["idle_p99_ms"]] * 2, color="black", lw=0.8,
                label=f"{ITL_GOAL:g}x alone (the goal)" if i == 0 else None)
        ax.annotate(f"{s['p99_ratio']}x", (i + 0.2, s["busy_p99_ms"] or 0), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(itl)))
    ax.set_xticklabels(itl, fontsize=8)
    ax.set_ylabel("decoding stream's p99 gap (ms)")
    ax.legend(fontsize=7)
    layers = sorted({r["layers"] for r in rows if "layers" in r})
    gpus = sorted({r["gpu"] for r in rows if r.get("event") == "booted" and r.get("gpu")})
    fig.suptitle(f"{'/'.join(map(str, layers))} layers, NVFP4 experts, dummy weights, {', '.join(gpus) or 'GPU not named'}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def report_cmd(args) -> int:
    rows = recipe_report.load_rows(args.files)  # the same JSONL reader as bench_recipe's report
    summary = report(rows)
    for label, s in summary.items():
        if "prefix" in s:
            print(f"{label}: hits (half the prefix or more) by the third prompt from {HIT_GOAL_FROM} tokens: "
                  f"{'met' if s['hit_goal_met'] else 'not met'}")
        else:
            print(f"{label}: (no prefix study)")
        for tail, by_n in s.get("prefix", {}).items():
            starts = s["hits_from_tokens"][tail]
            print(f"  tail {tail}: hits from {starts['send2']} tokens on the second prompt, "
                  f"{starts[f'send{SENDS}']} on the third")
            for n, c in sorted(by_n.items(), key=lambda kv: int(kv[0])):
                sends = "  ".join(f"#{k[4:]} hit {v['hit_tokens']:>6.0f} TTFT {v['ttft_ms']:>7} ms"
                                  for k, v in sorted(c.items()))
                print(f"    prefix {int(n):>6}: {sends}")
        if "itl" in s:
            i = s["itl"]
            print(f"  ITL p50 {i['idle_p50_ms']} ms, p99 idle {i['idle_p99_ms']} ms, under a {PREFILL}-token prefill "
                  f"{i['busy_p99_ms']} ms ({i['p99_ratio']}x; goal <= {ITL_GOAL}x for shared), p50 {i['busy_p50_ms']} ms "
                  f"over {i['busy_gaps']} gaps; the prefill's own TTFT {i['prefill_ttft_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.png:
        plot(summary, rows, args.png)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("dir", help="bench_recipe.py prepare's directory")
    p.add_argument("--out", required=True)
    p.add_argument("--logs")
    p.add_argument("--configs", default="stock,default,default-dense,shared")
    p.add_argument("--prefixes", default=",".join(map(str, PREFIXES)))
    p.add_argument("--tails", default=",".join(map(str, TAILS)))
    p.add_argument("--prefill", type=int, default=PREFILL)
    p.add_argument("--itl-tokens", type=int, default=ITL_TOKENS,
                   help=f"the idle stream's length (default {ITL_TOKENS}); the busy one decodes until the prefill is done")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=18750)
    p.add_argument("--boot-timeout", type=float, default=900)
    p.add_argument("--itl-only", help="configs measured for ITL only (a piece-size sweep: their prefix hits are "
                                      "the block's, the same as the config they vary)")
    br.add_set_option(p)
    p.set_defaults(func=run)
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    p.add_argument("--json")
    p.add_argument("--png", help="the plot: TTFT by prefix length, cold and cached; p99 gaps alone and under prefill")
    p.set_defaults(func=report_cmd)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
