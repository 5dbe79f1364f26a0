#!/usr/bin/env python3
"""The side layers' GEMMs at the real shapes, BF16 against FP8 block-scaled, per kernel vLLM can
pick on this GPU (issue 33: where the recipe's c >= 4 decode gap can be).

Usage (a CUDA machine with vLLM 0.33 importable; benchmarks/side-gemm-h100/README.md):
    python3 -m lab.bench_side_gemm [--out FILE.jsonl] [--tokens 3,12,24,48] [--paths auto,cutlass] [--quick]
    python3 -m lab.bench_side_gemm --plan      # the shapes and counts only, no GPU needed
    python3 -m lab.bench_side_gemm --report FILE.jsonl... [--png OUT.png]   # tables (+ a plot), no GPU

Stock serves the published layout, whose side layers (GDN and QSA projections, shared expert) are
BF16: vLLM's Qwen4Exp runs them through its own `qwen4_exp_low_latency_gemm` (a tuned skinny GEMM
where its table has a plan for the shape, token count and GPU, else `F.linear`). `flash serve
default` (MODE=hybrid) serves them as FP8_PB_WO: vLLM's block-scaled W8A8 linear, a per-token-group
activation quantization (QuantFP8, the CUDA op: the server enables `+quant_fp8`) and then the
kernel `init_fp8_linear_kernel` picks. This times each side by itself in CUDA graphs (the FULL decode
graphs' regime), at M = batch x (1 + MTP) tokens, with as many weight copies per graph as keep the
working set at >= 4x the L2 cache (the real model streams 48 layers of distinct weights), and sums
per-forward totals with each shape's count in the 48-layer model. It says what a target forward
pays for the side layers' format; the recipe48 ablation `default-nvfp4` measures the same question
end to end.

Rows: `gemm` (shape, M, path, per-call microseconds, raw samples), `check` (each FP8 path's output
against BF16 on the dequantized weight: a wrong layout or scale gives ~100% error, FP8 rounding
~3%), `skip` (a kernel this GPU or build cannot run, with vLLM's reason), `summary` (per M: each
path's per-forward milliseconds and its difference from BF16). Exit codes: 0 every check passed;
1 a check failed or a measurement errored; 2 bad arguments; 3 no CUDA device or no vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import traceback
from pathlib import Path
from typing import Callable

from flash_common.provenance import tree_commit
from lab import bench_step_kernels as bk
from lab.decode import model

ROOT = Path(__file__).resolve().parents[1]

EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_NO_CUDA = 1, 2, 3
BLOCK = 128                      # FP8_PB_WO's weight block (128 x 128) and activation group (1 x 128)
L2_MULTIPLE = 4                  # each graph's weights span at least this many L2 caches
MAX_COPIES = 64
CHECK_TOLERANCE = 0.08           # relative error norm; e4m3 rounding of activations gives ~0.03
# the FP8 block kernels vLLM 0.33 lists for CUDA, forced one at a time (init_fp8_linear_kernel
# falls back to its own choice when a forced kernel cannot run: that is reported as a skip)
FORCED = {"cutlass": "CutlassFp8BlockScaledMMKernel", "deepgemm": "DeepGemmFp8BlockScaledMMKernel",
          "triton": "TritonFp8BlockScaledMMKernel", "flashinfer": "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"}
PATHS = ("auto", *FORCED)   # "auto" = the kernel init_fp8_linear_kernel picks itself, as the server does


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    n: int            # output features
    k: int            # input features
    per_forward: int  # how many of these one target forward runs (48 layers)


def side_shapes(cfg: dict | None = None) -> list[Shape]:
    """The FP8 side linears of MODE=hybrid (lab.bench_recipe.side_modules) as vLLM merges them, from
    the text config. vLLM's own GB10 plan table (low_latency_gemm.QWEN4_EXP_SM121_GEMM_PLANS) lists
    the same five TP=1 shapes."""
    c = cfg or model.text_config(model.FULL_NGRAM_BASE)
    h = c["hidden_size"]
    kinds = c["layer_types"]
    gdn, qsa = kinds.count("linear_attention"), kinds.count("full_attention")
    key, val = c["linear_num_key_heads"] * c["linear_key_head_dim"], c["linear_num_value_heads"] * c["linear_value_head_dim"]
    heads = c["num_attention_heads"] * c["head_dim"]
    gate = 2 if c.get("output_gate_type") else 1          # q and its sigmoid output gate, one projection
    kv = 2 * c["num_key_value_heads"] * c["head_dim"]
    index = (c["indexer_n_heads"] + c["indexer_kv_heads"]) * c["indexer_head_dim"]
    shared = c["shared_expert_intermediate_size"]
    return [
        Shape("gdn.in_proj_qkvz", 2 * key + 2 * val, h, gdn),      # q, k, v, z
        Shape("gdn.out_proj", h, val, gdn),
        Shape("qsa.qkv_indexer", heads * gate + kv + index, h, qsa),
        Shape("qsa.o_proj", h, heads, qsa),
        Shape("shared.gate_up", 2 * shared, h, gdn + qsa),
        Shape("shared.down", h, shared, gdn + qsa),
    ]


def copies_for(weight_bytes: int, l2_bytes: int) -> int:
    """Weight copies one graph cycles through so its working set is >= L2_MULTIPLE L2 caches."""
    return max(2, min(MAX_COPIES, math.ceil(L2_MULTIPLE * l2_bytes / max(weight_bytes, 1))))


def parse_paths(text: str) -> tuple[str, ...]:
    paths = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in paths if p not in PATHS]
    if not paths or bad:
        raise SystemExit(f"--paths {text!r}: give comma-separated FP8 paths from {', '.join(PATHS)}")
    return paths


def parse_tokens(text: str) -> tuple[int, ...]:
    try:
        ms = tuple(int(t) for t in text.split(","))
    except ValueError:
        ms = ()
    if not ms or any(m < 1 or m > 4096 for m in ms):
        raise SystemExit(f"--tokens {text!r}: give comma-separated token counts from 1 to 4096, e.g. 3,12,24,48")
    return ms


# --- the two formats, built as vLLM builds them -----------------------------------------------------

def quantize_blocks(torch, w):
    """W (bf16, [N, K]) -> (fp8 e4m3 [N, K], fp32 scales [N/128, K/128]) per 128 x 128 block, and
    the dequantized weight the checks compare against."""
    n, k = w.shape
    blocks = w.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).view(n, k).to(torch.bfloat16)
    return q.view(n, k), scale.contiguous(), deq


def random_weight(torch, shape: Shape, gen):
    """Block magnitudes spread over two decades, so a scale applied to the wrong block is an error
    the check sees."""
    w = torch.randn(shape.n, shape.k, generator=gen, device="cuda") * 0.02
    mag = torch.exp(torch.empty(shape.n // BLOCK, shape.k // BLOCK, device="cuda").uniform_(-2.3, 2.3, generator=gen))
    return (w.view(shape.n // BLOCK, BLOCK, shape.k // BLOCK, BLOCK) * mag[:, None, :, None]).view(shape.n, shape.k).to(torch.bfloat16)


def fp8_layer(torch, q, scale):
    """A module holding what FP8_PB_WO registers after loading (`weight` [N, K] e4m3, `weight_scale`
    [N/128, K/128]), before the kernel's own post-load step."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(q.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
    layer.weight_block_size = [BLOCK, BLOCK]
    return layer


def fp8_kernel(shape: Shape, force: str | None):
    """(kernel, name) as init_fp8_linear_kernel gives it for FP8_PB_WO's keys, or (None, reason)."""
    import torch
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8Dynamic128Sym, kFp8Static128BlockSym

    forced = getattr(linear, force) if force else None
    kernel = linear.init_fp8_linear_kernel(activation_quant_key=kFp8Dynamic128Sym, weight_quant_key=kFp8Static128BlockSym,
                                           input_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                                           weight_shape=(shape.n, shape.k), force_kernel=forced)
    if forced is not None and type(kernel) is not forced:
        _, why = linear.is_supported_and_can_implement_kernel(forced, kernel.config, None)
        return None, why.strip() or f"init_fp8_linear_kernel picked {type(kernel).__name__} instead"
    return kernel, type(kernel).__name__


def bf16_gemm():
    """(forward, what it is, {(N, K): plan}) for the BF16 side layers as stock's Qwen4Exp runs them:
    vLLM's model op (a skinny GEMM where its table has a plan for the shape, M and this GPU, else
    F.linear) with this GPU's plan table, or plain F.linear when the op would not import."""
    try:
        from vllm.models.qwen4_exp.nvidia import low_latency_gemm as llg
        from vllm.platforms import current_platform

        plans = llg.QWEN4_EXP_GEMM_PLANS_BY_CAPABILITY.get(current_platform.get_device_capability(), {})
        return llg._qwen4_exp_low_latency_gemm, "qwen4_exp_low_latency_gemm", plans
    except Exception as e:  # noqa: BLE001 - said in the row, F.linear is what runs without a plan
        import torch.nn.functional as F
        return F.linear, f"F.linear (the model op did not import: {type(e).__name__}: {e})", {}


# --- the run ---------------------------------------------------------------------------------------

def timing_plan(quick: bool, copies: int) -> bk.Plan:
    base = bk.make_plan("quick" if quick else "full")
    return dataclasses.replace(base, warmup=3, graph_reps=copies, graph_replays=20 if quick else 40)


def cycling(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs the next copy's call each time (a graph of len(calls) captures each once)."""
    state = {"i": 0}

    def step():
        i = state["i"]
        state["i"] = (i + 1) % len(calls)
        return calls[i]()
    return step


def run_shape(torch, sink: bk.Sink, shape: Shape, tokens: tuple[int, ...], fp8_paths: tuple[str, ...], quick: bool,
              l2: int, gen) -> None:
    w = random_weight(torch, shape, gen)
    q, scale, deq = quantize_blocks(torch, w)
    del w
    n_copies = copies_for(q.numel(), l2)   # sized by the FP8 weight; the BF16 copies span twice the bytes
    gemm, bf16_path, plans = bf16_gemm()
    bf16_weights = [deq.clone() for _ in range(n_copies)]
    paths: dict[str, tuple[object, list]] = {}
    for path in fp8_paths:
        label, force = "fp8_" + path, FORCED.get(path)
        try:
            kernel, name = fp8_kernel(shape, force)
            if kernel is None:
                sink.emit({"kind": "skip", "shape": shape.name, "path": label, "reason": name})
                continue
            layers = [fp8_layer(torch, q, scale) for _ in range(n_copies)]
            for layer in layers:
                kernel.process_weights_after_loading(layer)
            paths[label] = (kernel, layers)
            quant = getattr(kernel, "quant_fp8", None)
            sink.emit({"kind": "picked", "shape": shape.name, "path": label, "kernel": name,
                       "quant": getattr(getattr(quant, "_forward_method", None), "__name__", None)})
        except Exception as e:  # noqa: BLE001 - recorded; the other paths still run
            sink.emit({"kind": "skip", "shape": shape.name, "path": label, "error": f"{type(e).__name__}: {e}",
                       "trace": traceback.format_exc()[-1500:]})
    plan = timing_plan(quick, n_copies)
    for m in tokens:
        xs = torch.randn(m, shape.k, generator=gen, device="cuda").to(torch.bfloat16)
        ref = torch.nn.functional.linear(xs, deq).float()
        jobs: dict[str, Callable[[], object]] = {
            "bf16": cycling([(lambda wt=wt: gemm(xs, wt)) for wt in bf16_weights])}
        for label, (kernel, layers) in paths.items():
            out = kernel.apply_weights(layers[0], xs)
            err = float((out.float() - ref).norm() / ref.norm())
            sink.emit({"kind": "check", "shape": shape.name, "m": m, "path": label, "rel_err": round(err, 5),
                       "ok": err <= CHECK_TOLERANCE})
            jobs[label] = cycling([(lambda lay=lay, k=kernel: k.apply_weights(lay, xs)) for lay in layers])
        auto = paths.get("fp8_auto")
        if auto is not None and getattr(auto[0], "apply_input_quant", False):
            jobs["fp8_auto.quant_only"] = lambda k=auto[0]: k.quant_fp8(xs, None, None)
        for label, fn in jobs.items():
            row = {"kind": "gemm", "shape": shape.name, "n": shape.n, "k": shape.k, "m": m, "path": label,
                   "per_forward": shape.per_forward, "copies": n_copies}
            if label == "bf16":
                row["bf16_path"] = bf16_path
                row["skinny_plan"] = m in plans.get((shape.n, shape.k), {})
            try:
                us = bk.time_graph(torch, fn, plan)
                sink.emit({**row, **bk.stats(us), "raw_us": [round(u, 3) for u in us]})
            except Exception as e:  # noqa: BLE001
                sink.emit({**row, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]})
    del paths, bf16_weights
    torch.cuda.empty_cache()


def summarize(records: list[dict]) -> dict:
    """Per M, each path's per-forward milliseconds over the shapes it ran (Σ count x median) and its
    difference from BF16 over the same shapes."""
    rows = [r for r in records if r.get("kind") == "gemm" and "median_us" in r]
    out: dict[str, dict] = {}
    for m in sorted({r["m"] for r in rows}):
        at = [r for r in rows if r["m"] == m]
        bf16 = {r["shape"]: r for r in at if r["path"] == "bf16"}
        per: dict[str, dict] = {}
        for path in sorted({r["path"] for r in at}):
            mine = {r["shape"]: r for r in at if r["path"] == path}
            both = sorted(set(mine) & set(bf16))
            ms = sum(mine[s]["per_forward"] * mine[s]["median_us"] for s in mine) / 1e3
            base = sum(bf16[s]["per_forward"] * bf16[s]["median_us"] for s in both) / 1e3
            mine_both = sum(mine[s]["per_forward"] * mine[s]["median_us"] for s in both) / 1e3
            per[path] = {"forward_ms": round(ms, 4), "shapes": len(mine),
                         "minus_bf16_ms": round(mine_both - base, 4) if both else None,
                         "ratio_to_bf16": round(mine_both / base, 4) if both and base else None}
        out[str(m)] = per
    return out


def report(files: list[Path], png: Path | None) -> str:
    """Markdown: per shape and M, each path's median microseconds; then per-forward totals (48
    layers) and each path's difference from the BF16 of its own file (the pairs of one run). A path
    timed in two files (BF16 is in every one) is shown from the first."""
    runs = [[json.loads(line) for line in f.read_text().splitlines() if line.strip()] for f in files]
    med: dict[tuple[str, int], dict[str, float]] = {}
    for rows in runs:  # a path in two files: the first file's
        for r in rows:
            if r.get("kind") == "gemm" and "median_us" in r:
                med.setdefault((r["shape"], r["m"]), {}).setdefault(r["path"], r["median_us"])
    paths = sorted({p for v in med.values() for p in v}, key=lambda p: (p != "bf16", p))
    out = ["| shape | M | " + " | ".join(f"{p} (µs)" for p in paths) + " |", "|---|---|" + "---|" * len(paths)]
    for (shape, m), v in sorted(med.items(), key=lambda kv: ([s.name for s in side_shapes()].index(kv[0][0]), kv[0][1])):
        out.append(f"| {shape} | {m} | " + " | ".join(f"{v[p]:.1f}" if p in v else "—" for p in paths) + " |")
    summaries: dict[int, dict[str, dict]] = {}
    for rows in runs:  # as above: the first file's
        for m, per in summarize(rows).items():
            for p, row in per.items():
                summaries.setdefault(int(m), {}).setdefault(p, row)
    out += ["", "| M | " + " | ".join(f"{p}: ms per forward (− BF16)" for p in paths) + " |", "|---|" + "---|" * len(paths)]
    for m in sorted(summaries):
        cells = []
        for p in paths:
            row = summaries[m].get(p)
            cells.append("—" if row is None else f"{row['forward_ms']:.2f}" + (
                "" if p == "bf16" or p.endswith("quant_only") or row["minus_bf16_ms"] is None else f" ({row['minus_bf16_ms']:+.2f})"))
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    if png is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ms = sorted(summaries)
        shown = [p for p in paths if not p.endswith("quant_only")]
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(shown)
        for i, p in enumerate(shown):
            ys = [summaries[m].get(p, {}).get("forward_ms", 0) for m in ms]
            ax.bar([j + i * width for j in range(len(ms))], ys, width, label=p)
        ax.set_xticks([j + width * (len(shown) - 1) / 2 for j in range(len(ms))])
        ax.set_xticklabels([f"M={m}" for m in ms])
        ax.set_ylabel("side-layer GEMMs per target forward, 48 layers (ms)")
        device = next((r for rows in runs for r in rows if r.get("kind") == "device"), {})
        ax.set_title(f"BF16 vs FP8 block-scaled side linears, {device.get('gpu', '?')} (CUDA graphs)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
    return "\n".join(out)


def describe(torch) -> dict:
    import vllm
    p = torch.cuda.get_device_properties(0)
    return {"kind": "device", "gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
            "l2_bytes": int(p.L2_cache_size), "torch": torch.__version__, "vllm": vllm.__version__,
            "commit": tree_commit(ROOT)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    ap.add_argument("--tokens", default="3,12,24,48",
                    help="M values: batch x (1 + MTP) at c = 1, 4, 8, 16 with MTP 2 (default: %(default)s)")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="FP8 kernels to time beside BF16 (default: %(default)s; DeepGEMM and Triton JIT-compile "
                         "per shape, so a session may run them apart)")
    ap.add_argument("--quick", action="store_true", help="fewer graph replays")
    ap.add_argument("--plan", action="store_true", help="print the shapes and counts and exit (no GPU)")
    ap.add_argument("--report", type=Path, nargs="+", metavar="FILE", help="tables from earlier runs' JSON lines (no GPU)")
    ap.add_argument("--png", type=Path, help="with --report: a bar plot of the per-forward totals")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        tokens = parse_tokens(args.tokens)
        fp8_paths = parse_paths(args.paths)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return EXIT_USAGE
        return EXIT_USAGE if e.code else 0
    shapes = side_shapes()
    if args.report:
        missing = [str(f) for f in args.report if not f.is_file()]
        if missing:
            print(f"--report: no such file: {', '.join(missing)}", file=sys.stderr)
            return EXIT_USAGE
        print(report(args.report, args.png))
        return 0
    if args.plan:
        for s in shapes:
            print(json.dumps({"kind": "shape", **dataclasses.asdict(s)}))
        return 0
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"needs torch and vLLM 0.33 importable: {e}", file=sys.stderr)
        return EXIT_NO_CUDA
    if not torch.cuda.is_available():
        print("no CUDA device: this bench times GPU kernels (use --plan for the shapes)", file=sys.stderr)
        return EXIT_NO_CUDA
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

    out = args.out.open("w") if args.out else None
    sink = bk.Sink(out)
    try:
        info = sink.emit(describe(torch))
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        # a server with FP8_PB_WO layers appends "+quant_fp8" (VllmConfig), so QuantFP8 runs its CUDA op
        cfg = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none", "+quant_fp8"]))
        with set_current_vllm_config(cfg), torch.inference_mode():
            for s in shapes:
                run_shape(torch, sink, s, tokens, fp8_paths, args.quick, info["l2_bytes"], gen)
        sink.emit({"kind": "summary", "per_m": summarize(sink.records)})
    finally:
        if out:
            out.close()
    return EXIT_CHECK_FAILED if sink.failures else 0


if __name__ == "__main__":
    sys.exit(main())
