#!/usr/bin/env python3
"""Per-step kernel timings for issue 12: patch 10's reduced draft head and patch 8's QSA block
top-k, each against what stock vLLM runs in its place, plus the device's copy bandwidth.

Usage (a CUDA machine with vLLM 0.30+ and `src/` importable; benchmarks/decode-h200/KERNELS.md):
    python3 -m lab.bench_step_kernels [--out FILE.jsonl] [--quick]
    python3 -m lab.bench_step_kernels --cpu-smoke [--out FILE.jsonl]   # tiny shapes, CPU torch

What runs (the real model's shapes, bf16 head, fp32 indexer scores):
- draft head, T = 1, 4, 8 (one draft step at batch 1/4/8: vLLM's MTP proposer calls compute_logits
  on one row per request per draft step, two steps per decode step at MTP=2) and T = 3, 12, 24
  (batch x (1+2) positions, the bound if every position went through the head):
  `stock` = vLLM's own `LogitsProcessor.forward(lm_head, hidden)` over the 248,320-row head (what
  stock `Qwen4ExpMTP.compute_logits` returns); `patched` = patch 10's own `reduced_logits` on the
  state its `build_reduced` makes from the shipped 65,536-id set (GEMM + -inf scatter).
- QSA top-k, rows = batch x 3 (decode_query_len 3 at MTP=2), context 8k/32k/128k tokens
  (visible blocks = positions // 4), logits width = the compressed block table of a server with
  max_model_len 131072 or 500000 (flash's default CTX): `stock` = vLLM's `qsa_indexer._topk` (the
  function patch 8 replaces, its own dispatch: cooperative_topk at <= 64 rows on sm_90+ except
  sm_12x, else persistent_topk), `persistent` = torch.ops._C.persistent_topk with the same
  arguments (the op the GB10/sm_121 dispatch picks), `patched` = the replacement patch 8 installs
  (`_qsa_topk.make_hook(stock, "det", ...)`, i.e. exact `torch.topk`), `radix` = the candidate
  patch 8 installs with VLLM_QSA_DET_TOPK=radix (`_qsa_radix`: a Triton radix select over the
  visible columns only; on --cpu-smoke through Triton's interpreter), `repair` = what it installs
  with VLLM_QSA_DET_TOPK=repair (`make_hook(stock, "repair", ...)`: the `stock` above, then
  `_qsa_radix.repair_block_topk` rewriting its output deterministically; on --cpu-smoke the CPU
  stand-in, then the kernel through the interpreter), `repair_persistent` = the same repair after
  `persistent_topk` (GB10's stock op; read its ratio against `persistent`), `repair_serial` (CUDA
  only) = `stock`, then the repair as run43 timed it, one program per row (`slice_columns=None`):
  the sliced repair's before, side by side.
- copy bandwidth: a device-to-device copy of 4 GiB (1 GiB with --quick).
- PLE staging (patch 1's Stager, `ple_stage`): `lookup(ids, out=buffer)` at 3/12/24/48 tokens x 16
  heads on a synthetic table of the real row width, dedup_min 256 (run6's default) against 1025 (the
  default since: no dedup below the graph limit), wall time per call to a synchronised device (host
  work included).

Each timing is measured eager (CUDA events around every call) and, where capture works, inside a
CUDA graph (one graph holds `graph_reps` calls; per-call = replay time / reps), the regime of FULL
decode graphs. Every measurement prints one JSON line (raw per-call microseconds included), the
equality checks print theirs, and a `summary` line gives medians and the ratios. Exit codes: 0
all checks passed and every measurement ran; 1 a check failed or a measurement errored (the others
still run and print); 2 bad arguments or setup; 3 no CUDA device (without --cpu-smoke).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, TextIO

from flash_vllm.ple.config import GRAPH_MAX_ROWS  # stdlib only: the Stager's graph limit

ROOT = Path(__file__).resolve().parents[1]

EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_NO_CUDA = 1, 2, 3

# The real model (its published config.json; lab/decode/model.py spells it out) and an MTP=2 decode step.
HIDDEN, VOCAB, DRAFT_IDS = 2560, 248320, 65536
TOKEN_TOPK, COMPRESS_RATIO = 2048, 4          # indexer_budget, indexer_compress_ratio -> 512 blocks
DECODE_QUERY_LEN = 3                          # 1 verified + 2 draft positions per request
TOPK_WORKSPACE_BYTES = 1024 * 1024            # qsa_indexer._TOPK_WORKSPACE_BYTES in 0.30+
# flash's implementations, each timed against the references; repair_persistent = the repair after
# persistent_topk, what a GB10 (sm_121, whose stock dispatch is persistent_topk) runs: read it vs "persistent"
CANDIDATES = ("patched", "radix", "repair", "repair_persistent", "repair_serial")
TRITON_MODES = ("radix", "repair")            # the candidates that run a Triton kernel


class BenchError(RuntimeError):
    """Bad arguments or a setup that cannot run (exit 2), with the reason in one line."""


@dataclasses.dataclass(frozen=True)
class Plan:
    device: str
    hidden: int
    vocab: int
    n_ids: int
    draft_tokens: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    max_model_lens: tuple[int, ...]
    token_topk: int
    warmup: int
    iters: int
    graph_reps: int
    graph_replays: int
    copy_bytes: int
    copy_iters: int
    # patch 1's Stager: decode steps of these many tokens (x 16 heads rows), a synthetic table of
    # stage_shards x stage_rows_per_shard rows of the real width
    stage_tokens: tuple[int, ...] = (3, 12, 24, 48)
    stage_shards: int = 128
    stage_rows_per_shard: int = 20000

    @property
    def block_topk(self) -> int:
        return self.token_topk // COMPRESS_RATIO


def make_plan(mode: str) -> Plan:
    if mode == "cpu-smoke":
        return Plan("cpu", 64, 1000, 256, (1, 3), (1, 2), (512, 1024), (2048,), 32,
                    warmup=1, iters=3, graph_reps=0, graph_replays=0, copy_bytes=8 << 20, copy_iters=3,
                    stage_tokens=(3, 24), stage_shards=6, stage_rows_per_shard=997)
    quick = mode == "quick"
    return Plan("cuda", HIDDEN, VOCAB, DRAFT_IDS, (1, 3, 4, 8, 12, 24), (1, 4, 8),
                (8192, 32768, 131072), (131072, 500000), TOKEN_TOPK,
                warmup=5 if quick else 20, iters=50 if quick else 200, graph_reps=10 if quick else 20,
                graph_replays=20 if quick else 40,
                copy_bytes=(1 if quick else 4) << 30, copy_iters=5 if quick else 10)


def columns_for(max_model_len: int) -> int:
    """Width of the decode logits: the compressed block table of a max_model_len request
    (page_table.shape[1] * k_cache.shape[1] in vLLM; rounded to 64 here, the exact width depends
    on the KV block size), so it follows max_model_len, not the request's context."""
    blocks = -(-max_model_len // COMPRESS_RATIO)
    return -(-blocks // 64) * 64


# --- statistics and output -------------------------------------------------------------------

def stats(us: list[float]) -> dict:
    xs = sorted(us)

    def q(p: float) -> float:
        if len(xs) == 1:
            return xs[0]
        pos = p * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"n": len(xs), "median_us": round(q(0.5), 3), "p10_us": round(q(0.1), 3),
            "p90_us": round(q(0.9), 3), "min_us": round(xs[0], 3)}


class Sink:
    """JSON lines to stdout and, with --out, to a file; remembers the records for the summary."""

    def __init__(self, out: TextIO | None):
        self.out, self.records, self.failures = out, [], []

    def emit(self, rec: dict) -> dict:
        line = json.dumps(rec, sort_keys=True)
        print(line, flush=True)
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()
        self.records.append(rec)
        if rec.get("error") or rec.get("ok") is False:
            self.failures.append(rec)
        return rec


# --- timing ----------------------------------------------------------------------------------

def time_eager(torch, fn: Callable[[], object], plan: Plan) -> list[float]:
    """Per-call microseconds: CUDA events around each call (perf_counter on CPU)."""
    for _ in range(plan.warmup):
        fn()
    if plan.device != "cuda":
        out = []
        for _ in range(plan.iters):
            t0 = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - t0) / 1e3)
        return out
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(plan.iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(plan.iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def time_graph(torch, fn: Callable[[], object], plan: Plan) -> list[float]:
    """Per-call microseconds inside a CUDA graph of `graph_reps` calls: one sample per replay
    (replay time / reps), `graph_replays` samples."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(plan.warmup, 3)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(plan.graph_reps):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(plan.graph_replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(plan.graph_replays)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    del graph
    return [s.elapsed_time(e) * 1e3 / plan.graph_reps for s, e in zip(starts, ends)]


def measure(torch, sink: Sink, plan: Plan, jobs: list[tuple[dict, dict[str, Callable[[], object]]]]) -> None:
    """Time every (shape, implementations) job: all eager first, then all in CUDA graphs, so a
    capture that fails (recorded, the others go on) comes after every eager number."""
    modes = ("eager", "graph") if plan.device == "cuda" and plan.graph_reps else ("eager",)
    for mode in modes:
        for base, impls in jobs:
            for impl, fn in impls.items():
                rec = dict(base, kind=base["bench"], impl=impl, mode=mode)
                try:
                    us = (time_graph if mode == "graph" else time_eager)(torch, fn, plan)
                    rec.update(stats(us), raw_us=[round(u, 3) for u in us])
                except Exception as e:  # one failed measurement must not cost the others
                    rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
                    if plan.device == "cuda":
                        torch.cuda.synchronize()
                sink.emit(rec)


# --- 1. draft head (patch 10) ----------------------------------------------------------------

class _PlainProcessor:
    """vLLM's LogitsProcessor at TP=1, unquantized, model dtype, no soft cap (used only where vLLM
    is not importable: the unit tier's CPU smoke). Same attributes patch 10 reads."""

    def __init__(self, vocab: int):
        self.vocab_size = self.org_vocab_size = vocab
        self.scale, self.soft_cap, self.logits_as_input, self.head_dtype = 1.0, None, False, None

    def __call__(self, lm_head, hidden_states):
        import torch.nn.functional as F

        return F.linear(hidden_states, lm_head.weight)[..., : self.org_vocab_size]


def stock_head(torch, weight, vocab: int, device: str):
    """(lm_head, logits_processor, label): vLLM's own LogitsProcessor and unquantized head method
    when vLLM imports, else the plain equivalent (labelled)."""
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    head.tp_size = 1
    try:
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    except ImportError as e:
        return head, _PlainProcessor(vocab), f"F.linear (vLLM not importable: {e})"
    head.quant_method = UnquantizedEmbeddingMethod()
    try:  # LogitsProcessor reads the current VllmConfig (head_dtype); a default one where none is set
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.config.vllm import get_current_vllm_config_or_none

        if get_current_vllm_config_or_none() is not None:
            return head, LogitsProcessor(vocab), "vllm.LogitsProcessor"
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=device))):
            return head, LogitsProcessor(vocab), "vllm.LogitsProcessor"
    except Exception as e:  # labelled, and the equality check still guards the comparison
        return head, _PlainProcessor(vocab), f"F.linear (vLLM's LogitsProcessor failed: {type(e).__name__}: {e})"[:300]


def draft_ids(plan: Plan):
    import numpy as np

    from flash_vllm.patches import p10_mtp_draft_vocab as draft_vocab

    if (plan.vocab, plan.n_ids) != (VOCAB, DRAFT_IDS):  # smoke shapes: a seeded random id set
        rng = np.random.default_rng(10)
        return np.sort(rng.choice(plan.vocab, plan.n_ids, replace=False)).astype(np.int64), "random (smoke)"
    path = draft_vocab.data_dir() / draft_vocab.DEFAULT_FILE
    ids = draft_vocab.load_ids(path, plan.vocab)
    if ids.size != plan.n_ids:
        raise BenchError(f"{path} holds {ids.size} ids, expected {plan.n_ids}")
    return ids, str(path.relative_to(ROOT / "src")) if path.is_relative_to(ROOT / "src") else str(path)


def check_reduced(torch, full, reduced, ids) -> dict:
    """The reduced logits equal the full ones on the id set (same columns) and are -inf elsewhere.

    Values are compared within 2 bf16 ulps (the two GEMMs may tile and accumulate differently);
    `bitwise_equal` says whether they also match bit for bit."""
    in_set = torch.zeros(full.shape[-1], dtype=torch.bool, device=full.device)
    in_set[ids] = True
    off = reduced[:, ~in_set]
    on_r, on_f = reduced[:, in_set].float(), full[:, in_set].float()
    diff = (on_r - on_f).abs()
    tol = 2.0 ** -6 * on_f.abs().clamp_min(1.0)  # 2 ulps of bf16 (8 mantissa bits)
    res = {
        "shape_ok": tuple(reduced.shape) == tuple(full.shape) and reduced.dtype == full.dtype,
        "minus_inf_elsewhere": bool(torch.isneginf(off).all()) if off.numel() else True,
        "finite_on_set": bool(torch.isfinite(on_r).all()),
        "within_2ulp": bool((diff <= tol).all()),
        "bitwise_equal": bool(torch.equal(on_r, on_f)),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        # informational: bf16 near-ties may flip it where the values are not bitwise equal
        "argmax_equal": bool(torch.equal(reduced.float().argmax(-1), ids[on_f.argmax(-1)])),
    }
    res["ok"] = res["shape_ok"] and res["minus_inf_elsewhere"] and res["finite_on_set"] and res["within_2ulp"]
    return res


def bench_draft_head(torch, sink: Sink, plan: Plan) -> None:
    from flash_vllm.patches import p10_mtp_draft_vocab as draft_vocab

    ids_np, source = draft_ids(plan)
    gen = torch.Generator(device=plan.device).manual_seed(0)
    weight = (torch.randn(plan.vocab, plan.hidden, generator=gen, device=plan.device) /
              math.sqrt(plan.hidden)).to(torch.bfloat16)
    head, proc, stock_label = stock_head(torch, weight, plan.vocab, plan.device)
    state = draft_vocab.build_reduced(SimpleNamespace(lm_head=head, logits_processor=proc), ids_np)
    if state is draft_vocab._PASS:
        raise BenchError("patch 10's build_reduced passed through on a plain bf16 head")
    ids = torch.as_tensor(ids_np, device=plan.device)
    jobs = []
    for t in plan.draft_tokens:
        h = (torch.randn(t, plan.hidden, generator=gen, device=plan.device)).to(torch.bfloat16)
        base = {"bench": "draft_head", "tokens": t, "hidden": plan.hidden, "vocab": plan.vocab,
                "ids": int(ids.numel()), "ids_source": source, "stock_impl": stock_label,
                "device": plan.device}
        with torch.inference_mode():
            full, reduced = proc(head, h), draft_vocab.reduced_logits(state, proc, h)
            sink.emit(dict(base, kind="check", **check_reduced(torch, full, reduced, ids)))
            del full, reduced
        jobs.append((base, {"stock": lambda h=h: proc(head, h),
                            "patched": lambda h=h: draft_vocab.reduced_logits(state, proc, h)}))
    with torch.inference_mode():
        measure(torch, sink, plan, jobs)


# --- 2. QSA block top-k (patch 8) ------------------------------------------------------------

def stock_qsa_topk():
    """vLLM's own `qsa_indexer._topk` (0.30+), unwrapped if the flash plugin already hooked it."""
    import inspect

    try:
        from vllm.models.qwen4_exp.nvidia.ops import qsa_indexer
    except ImportError as e:
        raise BenchError(f"vLLM's QSA indexer does not import ({e}); the QSA bench needs vLLM 0.30+") from e
    fn = getattr(qsa_indexer, "_topk", None)
    if fn is None:
        raise BenchError("vllm...ops.qsa_indexer has no _topk: this vLLM predates 0.30 (0.29 inlines "
                         "the top-k dispatch) or moved it; the bench times the 0.30+ hook only")
    fn = getattr(fn, "__flash_original__", fn)
    src = inspect.getsource(fn)
    for anchor in ("torch.ops._C.persistent_topk", "block_topk = token_topk // compress_ratio", "logits.shape[1]"):
        if anchor not in src:
            raise BenchError(f"vLLM's _topk no longer contains {anchor!r}: re-read it before timing")
    return fn


def persistent_topk(logits, visible_blocks, token_topk, compress_ratio, block_indices, topk_workspace):
    """torch.ops._C.persistent_topk with the arguments stock `_topk` gives it (the sm_12x choice)."""
    import torch

    torch.ops._C.persistent_topk(logits, visible_blocks, block_indices, topk_workspace,
                                 token_topk // compress_ratio, logits.shape[1])


def cpu_standin_topk(logits, visible_blocks, token_topk, compress_ratio, block_indices, topk_workspace):
    """CPU stand-in with the stock ops' contract, for --cpu-smoke only: rows are sets (order not
    sorted: reversed here), -1 fill past min(k, visible)."""
    import torch

    k = token_topk // compress_ratio
    block_indices.fill_(-1)
    for r in range(logits.shape[0]):
        v = int(visible_blocks[r])
        kk = min(k, v)
        if kk:
            block_indices[r, :kk] = torch.topk(logits[r, :v], kk).indices.flip(0).to(block_indices.dtype)


def visible_for(torch, batch: int, context: int, device: str):
    """Visible compressed blocks per decode row: request-major rows at positions ctx-3..ctx-1."""
    pos = torch.arange(context - DECODE_QUERY_LEN, context, device=device).repeat(batch)
    return (pos + 1).div(COMPRESS_RATIO, rounding_mode="floor").to(torch.int32)


def planted_logits(torch, rows: int, columns: int, visible: list[int], k: int, gen):
    """Scores without ties (built on the CPU, seeded): background -|N(0,1)| below 0, and in each
    row k+64 visible columns with distinct positive values exact in fp16 (1 + i/1024), so the top
    k is unique even for a kernel that bins in fp16. Returns (logits, expected top-k columns per
    row, sorted)."""
    logits = -torch.randn(rows, columns, generator=gen).abs()
    n = k + 64
    vals = 1.0 + torch.arange(n, dtype=torch.float32) / 1024
    expected = []
    for r, v in enumerate(visible):
        if v < n:
            raise BenchError(f"context too short for the check: {v} visible blocks < {n}")
        cols = torch.randperm(v, generator=gen)[:n]
        logits[r, cols] = vals[torch.randperm(n, generator=gen)]
        top = cols[logits[r, cols].argsort(descending=True)[:k]]
        expected.append(sorted(top.tolist()))
    return logits, expected


def _rows_as_sets(block_indices) -> list[list[int]]:
    return [sorted(c for c in row if c >= 0) for row in block_indices.tolist()]


def bench_qsa_topk(torch, sink: Sink, plan: Plan) -> None:
    from flash_vllm.patches.p05_qsa_exact_topk import hook as _qsa_topk

    if plan.device == "cuda":
        import vllm._custom_ops  # noqa: F401  loads vllm._C, which registers torch.ops._C.*

        stock = stock_qsa_topk()
        for op in ("persistent_topk", "cooperative_topk"):
            if not hasattr(torch.ops._C, op):
                raise BenchError(f"torch.ops._C.{op} is missing: this vLLM build has no {op} kernel")
        impls = {"stock": stock, "persistent": persistent_topk}
        label = f"vllm qsa_indexer._topk ({_dispatch_label(torch)})"
    else:
        impls = {"stock": cpu_standin_topk}
        label = "cpu stand-in (smoke)"
    impls["patched"] = _qsa_topk.make_hook(impls["stock"], "det", "v0.30")
    why_not = triton_unavailable(plan.device)
    for mode in TRITON_MODES:  # repair wraps impls["stock"]: the real stock op on CUDA, the stand-in on CPU
        if why_not:
            sink.emit({"kind": "note", "bench": "qsa_topk", "impl": mode, "note": f"not run: {why_not}"})
        else:
            impls[mode] = _qsa_topk.make_hook(impls["stock"], mode, "v0.30")
    if not why_not and "persistent" in impls:
        impls["repair_persistent"] = _qsa_topk.make_hook(impls["persistent"], "repair", "v0.30")
        impls["repair_serial"] = serial_repair(impls["stock"])
    k = plan.block_topk
    gen = torch.Generator().manual_seed(8)  # the scores are made on the CPU, then moved
    ws = torch.empty(TOPK_WORKSPACE_BYTES, dtype=torch.uint8, device=plan.device)
    jobs = []
    for mml in plan.max_model_lens:
        columns = columns_for(mml)
        for ctx in plan.contexts:
            for batch in plan.batches:
                rows = batch * DECODE_QUERY_LEN
                visible = visible_for(torch, batch, ctx, plan.device)
                base = {"bench": "qsa_topk", "batch": batch, "rows": rows, "context": ctx,
                        "max_model_len": mml, "columns": columns, "block_topk": k,
                        "stock_impl": label, "device": plan.device}
                planted, expected = planted_logits(torch, rows, columns, visible.tolist(), k, gen)
                planted = planted.to(plan.device)
                random = torch.randn(rows, columns, generator=gen).to(plan.device)
                check = dict(base, kind="check")
                random_sets = {}
                for name, fn in list(impls.items()):
                    for data, key in ((planted, "planted"), (random, "random")):
                        out = torch.full((rows, k), -1, dtype=torch.int32, device=plan.device)
                        try:
                            fn(data.clone(), visible, plan.token_topk, COMPRESS_RATIO, out, ws)
                        except Exception as e:
                            if name in ("stock", "patched"):
                                raise
                            # a candidate that cannot run (run38: radix did not compile) is
                            # reported and dropped; the others are still timed
                            sink.emit(dict(base, kind="setup", impl=name,
                                           error=f"{type(e).__name__}: {e}".splitlines()[0][:400]))
                            del impls[name]
                            break
                        got = _rows_as_sets(out)
                        if key == "planted":
                            check[f"{name}_equals_expected"] = got == expected
                        else:
                            random_sets[name] = got
                check["random_sets_equal"] = {n: s == random_sets["patched"] for n, s in random_sets.items()}
                check["ok"] = all(v for n, v in check.items() if n.endswith("_equals_expected"))
                sink.emit(check)
                bufs = {n: (random.clone(), torch.full((rows, k), -1, dtype=torch.int32, device=plan.device))
                        for n in impls}
                jobs.append((base, {
                    n: (lambda fn=fn, b=bufs[n], v=visible: fn(b[0], v, plan.token_topk, COMPRESS_RATIO, b[1], ws))
                    for n, fn in impls.items()}))
    measure(torch, sink, plan, jobs)


def serial_repair(stock: Callable) -> Callable:
    """`stock`, then the repair as run43 timed it (one program per row): the before of the sliced one."""
    from flash_vllm.patches.p08_qsa_det_topk import radix as _qsa_radix

    def fn(logits, visible_blocks, token_topk, compress_ratio, block_indices, topk_workspace):
        stock(logits, visible_blocks, token_topk, compress_ratio, block_indices, topk_workspace)
        _qsa_radix.repair_block_topk(logits, visible_blocks, block_indices, token_topk // compress_ratio,
                                     logits.shape[1], slice_columns=None)

    return fn


def triton_unavailable(device: str) -> str | None:
    """Why the Triton candidates (`radix`, `repair`) cannot run here, or None. On a GPU it always runs (a missing
    Triton is an error like any other). On CPU it runs through Triton's interpreter, which
    TRITON_INTERPRET=1 switches on when Triton is first imported: set here when Triton is not
    imported yet; a process that already imported it for a GPU cannot switch (pytest's unit tier,
    where transformers imports Triton, runs the smoke in a child process for that reason)."""
    import os

    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if "triton" in sys.modules:
        return "Triton was imported before TRITON_INTERPRET=1 could be set (its interpreter cannot be switched on)"
    os.environ["TRITON_INTERPRET"] = "1"
    return None


def _dispatch_label(torch) -> str:
    major, minor = torch.cuda.get_device_capability()
    cc = major * 10 + minor
    coop = cc >= 90 and major != 12
    return (f"sm_{cc}: cooperative_topk for <= 64 rows, else persistent_topk" if coop
            else f"sm_{cc}: persistent_topk")


# --- 3. copy bandwidth -----------------------------------------------------------------------

def bench_bandwidth(torch, sink: Sink, plan: Plan) -> None:
    n = plan.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=plan.device).random_(0, 256)
    dst = torch.empty_like(src)
    small = dataclasses.replace(plan, warmup=2, iters=plan.copy_iters)
    base = {"bench": "copy_bandwidth", "bytes": n, "device": plan.device}
    try:
        us = time_eager(torch, lambda: dst.copy_(src), small)
        st = stats(us)
        sec = st["median_us"] / 1e6
        rec = dict(base, kind="copy_bandwidth", impl="d2d_copy", mode="eager", **st,
                   raw_us=[round(u, 3) for u in us],
                   gbps_read_plus_write=round(2 * n / sec / 1e9, 1), gbps_copied=round(n / sec / 1e9, 1),
                   ok=bool(torch.equal(dst[:4096], src[:4096]) and torch.equal(dst[-4096:], src[-4096:])))
    except Exception as e:
        rec = dict(base, kind="copy_bandwidth", error=f"{type(e).__name__}: {e}".splitlines()[0][:400])
    sink.emit(rec)
    del src, dst


# --- 4. patch 1's Stager: the dedup side against the short path -----------------------------

STAGE_HEADS = 16  # n-gram heads per token (8 per n-gram size, 2 sizes: the published config): rows per decode token
STAGE_IMPLS = {"dedup256": 256, "nodedup": GRAPH_MAX_ROWS + 1}  # dedup_min: run6's, and today's default (every decode batch below it)


def time_wall(torch, fn: Callable[[], object], plan: Plan) -> list[float]:
    """Per-call microseconds of host work + device work: wall time to a synchronised device (the
    hoisted hook's whole cost sits on the decode step's critical path, host part included)."""
    sync = torch.cuda.synchronize if plan.device == "cuda" else (lambda: None)
    for _ in range(plan.warmup):
        fn()
    sync()
    out = []
    for _ in range(plan.iters):
        t0 = time.perf_counter_ns()
        fn()
        sync()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def same_bits(torch, got, want) -> bool:
    """Bit-equal, except that a NaN only has to be a NaN: the random table holds fp8 NaN bytes,
    and the GPU's fp8->bf16 conversion writes another NaN payload than the CPU's (run7 failed all
    eight checks on that alone, while tests/gpu's NaN-aware comparison passed the same Stager)."""
    gn, wn = torch.isnan(got), torch.isnan(want)
    return bool(torch.equal(gn, wn) and torch.equal(got.view(torch.int16)[~gn], want.view(torch.int16)[~wn]))


def bench_ple_stage(torch, sink: Sink, plan: Plan) -> None:
    """`Stager.lookup(ids, out=buffer)` at decode sizes, warm table: dedup_min 256 (run6's default,
    which sends 24 tokens x 16 heads = 384 rows, c=8 at MTP=2, down the dedup path: np.unique,
    inverse, eager device ops) against 1025 (today's: every decode batch on the short path: one compiled
    gather, one graph replay). decode-h200/run6 measured hoisted +1.5 ms per step at c=8 and +0.4
    at c=1/4; this times the Stager alone, without a server's noise."""
    import tempfile

    import numpy as np

    from flash_vllm.ple.stager import Stager
    from flash_vllm.ple.synth import reference_rows, write_checkpoint
    from flash_vllm.ple.table import PLETable

    with tempfile.TemporaryDirectory(prefix="flash-stage-") as d:
        write_checkpoint(d, rows_per_shard=plan.stage_rows_per_shard, num_shards=plan.stage_shards)
        with PLETable.from_checkpoint(d) as t:
            stagers = {name: Stager(t, plan.device, dedup_min=m) for name, m in STAGE_IMPLS.items()}
            rng = np.random.default_rng(12)
            jobs = []
            for tokens in plan.stage_tokens:
                # 16 id sets in turn: a decode step's ids change every step
                sets = [rng.integers(0, t.num_rows, (tokens, STAGE_HEADS)) for _ in range(16)]
                want = torch.from_numpy(reference_rows(d, sets[0])).view(torch.float8_e4m3fn)
                want = (want.float() * t.scale).to(torch.bfloat16).view(tokens, STAGE_HEADS, t.head_dim)
                impls = {}
                for name, st in stagers.items():
                    buf = torch.empty(tokens, STAGE_HEADS, t.head_dim, dtype=torch.bfloat16, device=plan.device)
                    got = st.lookup(sets[0], out=buf)
                    sink.emit({"kind": "check", "bench": "ple_stage", "impl": name, "tokens": tokens,
                               "ok": same_bits(torch, got.cpu(), want)})
                    turn = iter(range(1 << 62))
                    impls[name] = (lambda st=st, buf=buf, turn=turn, sets=sets: st.lookup(sets[next(turn) % 16], out=buf))
                jobs.append(({"bench": "ple_stage", "tokens": tokens, "rows": tokens * STAGE_HEADS}, impls))
            for base, impls in jobs:
                for impl, fn in impls.items():
                    rec = dict(base, kind="ple_stage", impl=impl, mode="wall", dedup_min=STAGE_IMPLS[impl])
                    try:
                        us = time_wall(torch, fn, plan)
                        rec.update(stats(us), raw_us=[round(u, 3) for u in us])
                    except Exception as e:
                        rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
                    sink.emit(rec)


# --- summary ---------------------------------------------------------------------------------

GOALS = {"draft_head": 0.30, "qsa_topk": 1.0}


def summarize(records: list[dict]) -> dict:
    """Median per-call time of each implementation and the patched/stock (and patched/persistent)
    ratios per shape and timing mode, with the goal each ratio is judged against."""
    med: dict[tuple, float] = {}
    for r in records:
        if r.get("kind") in GOALS and "median_us" in r:
            shape = tuple(sorted((k, v) for k, v in r.items() if k in
                                 ("tokens", "batch", "context", "max_model_len")))
            med[(r["kind"], shape, r["mode"], r["impl"])] = r["median_us"]
    ratios = []
    for (kind, shape, mode, impl), us in sorted(med.items(), key=lambda kv: kv[0][:3]):
        if impl not in CANDIDATES:
            continue
        for ref in ("stock", "persistent"):
            den = med.get((kind, shape, mode, ref))
            if den:
                ratios.append(dict(shape, bench=kind, mode=mode, vs=ref, impl=impl, patched_us=us, ref_us=den,
                                   ratio=round(us / den, 3), goal=GOALS[kind],
                                   meets_goal=us / den <= GOALS[kind]))
    checks = [r for r in records if r.get("kind") == "check"]
    bw = next((r for r in records if r.get("kind") == "copy_bandwidth" and "gbps_read_plus_write" in r), None)
    out = {"kind": "summary", "ratios": ratios,
           "checks_passed": sum(1 for c in checks if c.get("ok")), "checks": len(checks),
           "errors": [f"{r.get('bench')}/{r.get('impl', '')}/{r.get('mode', '')}: {r['error']}"
                      for r in records if r.get("error")],
           "copy_gbps_read_plus_write": bw and bw["gbps_read_plus_write"],
           "gb10_over_this_device_bandwidth": bw and round(273.0 / bw["gbps_read_plus_write"], 4)}
    for kind in GOALS:
        rs = [r["ratio"] for r in ratios if r["bench"] == kind and r["vs"] == "stock" and r["impl"] == "patched"]
        out[f"{kind}_ratio_vs_stock_max"] = max(rs) if rs else None
    for impl in TRITON_MODES + ("repair_serial",):
        rs = [r["ratio"] for r in ratios if r["bench"] == "qsa_topk" and r["vs"] == "stock" and r["impl"] == impl]
        out[f"qsa_topk_{impl}_ratio_vs_stock_max"] = max(rs) if rs else None
    rs = [r["ratio"] for r in ratios if r["bench"] == "qsa_topk" and r["vs"] == "persistent"
          and r["impl"] == "repair_persistent"]
    out["qsa_topk_repair_persistent_ratio_vs_persistent_max"] = max(rs) if rs else None
    stage = {(r["tokens"], r["impl"]): r for r in records if r.get("kind") == "ple_stage" and "median_us" in r}
    out["ple_stage"] = [{"tokens": tok, "rows": r["rows"], "dedup256_us": r["median_us"],
                         "nodedup_us": stage[(tok, "nodedup")]["median_us"],
                         "ratio_nodedup_vs_dedup256": round(stage[(tok, "nodedup")]["median_us"] / r["median_us"], 3)}
                        for (tok, impl), r in sorted(stage.items()) if impl == "dedup256" and (tok, "nodedup") in stage]
    return out


def table(summary: dict) -> str:
    """The summary for a person (stderr): one line per ratio, then checks, errors, bandwidth."""
    lines = [f"{'bench':<11} {'impl':<7} {'shape':<44} {'mode':<5} {'vs':<10} {'patched_us':>10} {'ref_us':>10} "
             f"{'ratio':>6} goal"]
    for r in summary["ratios"]:
        shape = " ".join(f"{k}={r[k]}" for k in ("tokens", "batch", "context", "max_model_len") if k in r)
        lines.append(f"{r['bench']:<11} {r['impl']:<7} {shape:<44} {r['mode']:<5} {r['vs']:<10} {r['patched_us']:>10.1f} "
                     f"{r['ref_us']:>10.1f} {r['ratio']:>6.3f} {'<=' if r['meets_goal'] else '> '}{r['goal']}")
    lines.append(f"checks passed {summary['checks_passed']}/{summary['checks']}; errors {len(summary['errors'])}; "
                 f"copy {summary['copy_gbps_read_plus_write']} GB/s (read+write); wall {summary.get('wall_s')} s")
    lines += [f"ple_stage   tokens={r['tokens']:<3} rows={r['rows']:<4} dedup256 {r['dedup256_us']:>8.1f} us  "
              f"nodedup {r['nodedup_us']:>8.1f} us  ratio {r['ratio_nodedup_vs_dedup256']:.3f}"
              for r in summary.get("ple_stage", [])]
    lines += [f"  error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


# --- CLI -------------------------------------------------------------------------------------

BENCHES = {"draft_head": bench_draft_head, "qsa_topk": bench_qsa_topk, "copy_bandwidth": bench_bandwidth,
           "ple_stage": bench_ple_stage}

def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="also write the JSON lines to this file")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="fewer iterations, 1 GiB copy")
    g.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on CPU torch, few iterations: every path but the CUDA kernels")
    ap.add_argument("--only", choices=tuple(BENCHES), action="append",
                    help="run only these parts (repeatable); default all four")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        import torch
    except ImportError:
        print("bench_step_kernels: torch is not importable here", file=sys.stderr)
        return EXIT_USAGE
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_step_kernels: no CUDA device (torch.cuda.is_available() is False); run it on "
              "the GPU machine, or use --cpu-smoke for the CPU code-path check", file=sys.stderr)
        return EXIT_NO_CUDA
    if args.out and not args.out.parent.is_dir():
        print(f"bench_step_kernels: --out {args.out}: directory {args.out.parent} does not exist",
              file=sys.stderr)
        return EXIT_USAGE
    plan = make_plan("cpu-smoke" if args.cpu_smoke else "quick" if args.quick else "full")
    parts = args.only or list(BENCHES)
    fh = args.out.open("w") if args.out else None
    sink = Sink(fh)
    t0 = time.monotonic()
    try:
        env = {"kind": "env", "torch": torch.__version__, "device": plan.device, "plan": dataclasses.asdict(plan)}
        if plan.device == "cuda":
            env["gpu"] = torch.cuda.get_device_name()
            env["capability"] = list(torch.cuda.get_device_capability())
        try:
            import vllm

            env["vllm"] = getattr(vllm, "__version__", None)
        except ImportError:
            env["vllm"] = None
        sink.emit(env)
        for part in parts:
            try:
                BENCHES[part](torch, sink, plan)
            except BenchError as e:
                sink.emit({"kind": "setup", "bench": part, "error": str(e)})
            except Exception as e:
                sink.emit({"kind": "setup", "bench": part, "error": f"{type(e).__name__}: {e}".splitlines()[0][:400],
                           "traceback": traceback.format_exc()[-2000:]})
            if plan.device == "cuda":
                torch.cuda.empty_cache()
        summary = summarize(sink.records)
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        sink.emit(summary)
        print(table(summary), file=sys.stderr)
    finally:
        if fh:
            fh.close()
    if sink.failures:
        print(f"bench_step_kernels: {len(sink.failures)} failed check(s) or errored measurement(s); "
              "see the lines with ok=false or error", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
