"""What one engine step spends, read from a torch-profiler trace of a vLLM server (issue 33's open
"why": the fixed cost F of a step that carries a prompt piece beside a decoding stream, the recipe's
long-prompt TTFT against stock's, part by part).

vLLM (0.31+, `--profiler-config '{"profiler":"torch",…}'`, POST /start_profile, /stop_profile) has
the worker's torch profiler write a Chrome trace (Kineto's JSON, gzipped) and wraps each
`execute_model` in a `user_annotation` named for the step's requests:
`execute_context_C(CT)_generation_G(GT)`: C requests prefilling CT tokens, G decoding GT tokens.

A step here is one such annotation and everything its thread launches until the next one starts
(sampling and the MTP draft run in `sample_tokens`, outside the annotation, on the same thread):
- `period_ms`: from this step's annotation to the next one's, what a streaming client's gap follows;
- launches by kind: `eager` (cudaLaunchKernel and the driver's cuLaunchKernel*, Triton's path),
  `graphs` (cudaGraphLaunch: one replay of a captured piece), and the host ms spent inside them;
- `sync_ms`: host ms blocked in a synchronize call or a blocking copy;
- `host_ops`: ms of the thread's outermost operators (`cpu_op`: aten and vLLM's custom ops) by name;
- `sections`: ms of vLLM's own record_function sections (`gpu_model_runner: preprocess`, `forward`,
  `postprocess`, `sample`, `draft`, `bookkeep`) by name: where the host's part of the step goes;
- the GPU work those launches made, found by Kineto's `correlation` id (a graph's kernels carry
  its launch's): `gpu_busy_ms` (the union of their intervals), `gpu_span_ms` (first start to last
  end), ms by kernel family (a name pattern, FAMILIES) and by kernel name.
A GPU event whose correlation no launch in the trace carries is given to the step of the GPU event
before it on its stream, and counted (`unlinked`).

Steps are grouped by annotation name (a class: the same requests and token counts). A class's
figures are medians over its steps; `delta` sets one class against another (a mixed step against a
decode step: what the piece adds, GPU family by family, and what the host adds beyond the GPU).
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from pathlib import Path

STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
LAUNCH_EAGER = re.compile(r"^(cudaLaunchKernel|cudaLaunchKernelExC|cudaLaunchCooperativeKernel|cuLaunchKernel|cuLaunchKernelEx)(_v\d+)?$")
LAUNCH_GRAPH = re.compile(r"^cu(da)?GraphLaunch(_v\d+)?$")
SYNC = re.compile(r"Synchronize|^cudaMemcpy(_v\d+)?$|^cuMemcpyDtoH")
HOST_CATS = ("cuda_runtime", "cuda_driver")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

# first match wins; names lowered. Patterns, not proofs: `by_kernel` keeps the names themselves
FAMILIES: tuple[tuple[str, re.Pattern], ...] = tuple((n, re.compile(p)) for n, p in (
    ("moe", r"moe|marlin|humming|expert|topk_softmax|grouped_topk|fused_topk|align_block"),
    ("gdn", r"gated_delta|delta_rule|fused_recurrent|chunk_|causal_conv|conv1d|solve_tril|recompute_w_u|l2norm|gdn|kkt"),
    ("attention", r"flash|fmha|attn|attention|paged|reshape_and_cache|mla"),
    ("qsa", r"indexer|qsa|topk|top_k|radix|cooperative|persistent"),
    ("ple", r"engram|\bple|ple_|index_select|embedding|gather"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|matmul|cublas|splitk|deep_gemm|scaled_mm|wgmma"),
    ("quant", r"quant|fp8|fp4|e4m3|e8m0"),
    ("norm_act", r"norm|silu|gelu|act_and_mul|rotary|rope|softmax"),
    ("sample", r"sampl|argmax|argsort|sort|multinomial|logit|rejection"),
))


def family(name: str, cat: str = "kernel") -> str:
    if cat == "gpu_memcpy":
        return "memcpy"
    if cat == "gpu_memset":
        return "memset"
    low = name.lower()
    for fam, pat in FAMILIES:
        if pat.search(low):
            return fam
    return "other"


def load(path: str | Path) -> list[dict]:
    """The trace's complete ("X") events. Kineto writes {"traceEvents": [...], ...}; a bare list is
    accepted too (Chrome's other form)."""
    p = Path(path)
    opener = gzip.open if p.name.endswith(".gz") else open
    with opener(p, "rt", encoding="utf-8") as fh:
        doc = json.load(fh)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{p}: no traceEvents list (not a Chrome trace)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def _union_ms(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1000.0


def steps(events: list[dict]) -> list[dict]:
    """One dict per annotated step, in time order (module docstring)."""
    ann = sorted((e for e in events if e.get("cat") == "user_annotation" and STEP.match(str(e.get("name", "")))),
                 key=lambda e: float(e["ts"]))
    if not ann:
        return []
    # a step's window on its thread: its annotation's start to the next one's (the last: the trace's end)
    by_thread: dict = {}
    for e in ann:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    windows = []
    for thread, evs in by_thread.items():
        for i, e in enumerate(evs):
            start = float(e["ts"])
            nxt = float(evs[i + 1]["ts"]) if i + 1 < len(evs) else None
            # the last step's window runs to the trace's end: its sampling and draft come after it
            windows.append({"thread": thread, "start": start, "end": nxt if nxt is not None else float("inf"),
                            "period_ms": (nxt - start) / 1000.0 if nxt is not None else None, "ev": e})
    windows.sort(key=lambda w: w["start"])
    starts = {t: [w["start"] for w in windows if w["thread"] == t] for t in by_thread}
    idx = {t: [i for i, w in enumerate(windows) if w["thread"] == t] for t in by_thread}

    def owner(thread, ts: float) -> int | None:
        s = starts.get(thread)
        if not s:
            return None
        j = bisect.bisect_right(s, ts) - 1
        if j < 0:
            return None
        w = windows[idx[thread][j]]
        return idx[thread][j] if ts < w["end"] else None

    acc = [{"eager": 0, "graphs": 0, "launch_ms": 0.0, "sync_ms": 0.0, "corr": set()} for _ in windows]
    for e in events:
        if e.get("cat") not in HOST_CATS:
            continue
        k = owner((e.get("pid"), e.get("tid")), float(e["ts"]))
        if k is None:
            continue
        name, dur = str(e.get("name", "")), float(e.get("dur", 0)) / 1000.0
        a = acc[k]
        if LAUNCH_GRAPH.match(name):
            a["graphs"] += 1
            a["launch_ms"] += dur
        elif LAUNCH_EAGER.match(name):
            a["eager"] += 1
            a["launch_ms"] += dur
        elif SYNC.search(name):
            a["sync_ms"] += dur
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            a["corr"].add(corr)
    def outermost(chosen) -> list[dict[str, float]]:
        """ms by name of each thread's outermost chosen events, per step (one inside another is its part)."""
        per: list[dict[str, float]] = [{} for _ in windows]
        top_end: dict = {}
        for e in sorted(chosen, key=lambda e: (str(e.get("pid")), str(e.get("tid")), float(e["ts"]))):
            thread, ts, dur = (e.get("pid"), e.get("tid")), float(e["ts"]), float(e.get("dur", 0))
            if ts < top_end.get(thread, float("-inf")):
                continue
            top_end[thread] = ts + dur
            k = owner(thread, ts)
            if k is not None:
                name = str(e.get("name", ""))
                per[k][name] = per[k].get(name, 0.0) + dur / 1000.0
        return per

    host = outermost(e for e in events if e.get("cat") == "cpu_op")
    # vLLM's own sections of a step (`gpu_model_runner: preprocess`, `forward`, `sample`, `draft`, …)
    sections = outermost(e for e in events if e.get("cat") == "user_annotation" and not STEP.match(str(e.get("name", ""))))
    step_of = {c: k for k, a in enumerate(acc) for c in a["corr"]}
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: float(e["ts"]))
    per: list[list[dict]] = [[] for _ in windows]
    unlinked = [0] * len(windows)
    last_on_stream: dict = {}
    for e in gpu:
        stream = ((e.get("args") or {}).get("stream"), e.get("pid"), e.get("tid"))
        k = step_of.get((e.get("args") or {}).get("correlation"))
        if k is None:
            k = last_on_stream.get(stream)
            if k is None:
                continue
            unlinked[k] += 1
        last_on_stream[stream] = k
        per[k].append(e)
    out = []
    for k, w in enumerate(windows):
        m = STEP.match(w["ev"]["name"])
        evs = per[k]
        spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in evs]
        fam: dict[str, float] = {}
        names: dict[str, float] = {}
        for e in evs:
            d = float(e.get("dur", 0)) / 1000.0
            f = family(str(e.get("name", "")), e.get("cat"))
            fam[f] = fam.get(f, 0.0) + d
            names[str(e.get("name", ""))] = names.get(str(e.get("name", "")), 0.0) + d
        a = acc[k]
        out.append({"name": w["ev"]["name"], "ctx_reqs": int(m[1]), "ctx_tokens": int(m[2]), "gen_reqs": int(m[3]),
                    "gen_tokens": int(m[4]), "ts_us": w["start"], "period_ms": w["period_ms"],
                    "cpu_ms": float(w["ev"].get("dur", 0)) / 1000.0, "eager": a["eager"], "graphs": a["graphs"],
                    "launch_ms": a["launch_ms"], "sync_ms": a["sync_ms"], "gpu_events": len(evs),
                    "unlinked": unlinked[k], "gpu_busy_ms": _union_ms(spans),
                    "gpu_span_ms": (max(b for _, b in spans) - min(a for a, _ in spans)) / 1000.0 if spans else 0.0,
                    "by_family": fam, "by_kernel": names, "host_ops": host[k], "sections": sections[k]})
    return out


FIGURES = ("period_ms", "cpu_ms", "eager", "graphs", "launch_ms", "sync_ms", "gpu_events", "unlinked", "gpu_busy_ms",
           "gpu_span_ms")


def _med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def classes(rows: list[dict], top: int = 12) -> dict[str, dict]:
    """Per step class (annotation name): the step count and the median of every figure; the median
    ms of each kernel family, of the `top` kernel names and of the `top` host operators by that
    median (absent = 0 in a step).
    `idle_ms`: the period less the GPU's busy time, what the stream waits on the host or on gaps."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["name"], []).append(r)
    out = {}
    for name, rs in groups.items():
        fams = sorted({f for r in rs for f in r["by_family"]})
        kern = {n for r in rs for n in r["by_kernel"]}
        kmed = {n: _med([r["by_kernel"].get(n, 0.0) for r in rs]) for n in kern}
        topk = sorted(kmed, key=lambda n: -(kmed[n] or 0.0))[:top]
        hmed = {n: _med([r["host_ops"].get(n, 0.0) for r in rs]) for n in {n for r in rs for n in r["host_ops"]}}
        toph = sorted(hmed, key=lambda n: -(hmed[n] or 0.0))[:top]
        sec = {n: _med([r["sections"].get(n, 0.0) for r in rs]) for n in sorted({n for r in rs for n in r["sections"]})}
        periods = [r for r in rs if r["period_ms"] is not None]
        out[name] = {"steps": len(rs), "ctx_tokens": rs[0]["ctx_tokens"], "gen_tokens": rs[0]["gen_tokens"],
                     **{f: _med([r[f] for r in rs if r[f] is not None]) for f in FIGURES},
                     "idle_ms": _med([r["period_ms"] - r["gpu_busy_ms"] for r in periods]),
                     "by_family": {f: _med([r["by_family"].get(f, 0.0) for r in rs]) for f in fams},
                     "top_kernels": {n: kmed[n] for n in topk}, "top_host_ops": {n: hmed[n] for n in toph},
                     "sections": sec}
    return out


def delta(base: dict, other: dict) -> dict:
    """`other` less `base` (two classes from `classes`): every figure, every family (a family absent
    from one side counts 0 there), the kernels and host operators either side ranks in its top."""
    figs = {f: round(other[f] - base[f], 4) for f in (*FIGURES, "idle_ms")
            if other.get(f) is not None and base.get(f) is not None}

    def diff(key: str) -> dict[str, float]:
        names = sorted(set(base[key]) | set(other[key]))
        return {n: round((other[key].get(n) or 0.0) - (base[key].get(n) or 0.0), 4) for n in names}
    return {"figures": figs, "by_family": diff("by_family"), "top_kernels": diff("top_kernels"),
            "top_host_ops": diff("top_host_ops"), "sections": diff("sections")}


def summarize(path: str | Path, top: int = 12) -> dict:
    """A trace file's classes, its step count, the GPU events given to its steps (`unlinked`: of them,
    by stream order) and those outside every step (`outside`: before the first, launched elsewhere)."""
    events = load(path)
    rows = steps(events)
    gpu = sum(1 for e in events if e.get("cat") in GPU_CATS)
    mine = sum(r["gpu_events"] for r in rows)
    return {"trace": Path(path).name, "steps": len(rows), "gpu_events": mine, "unlinked": sum(r["unlinked"] for r in rows),
            "outside": gpu - mine, "classes": classes(rows, top)}
