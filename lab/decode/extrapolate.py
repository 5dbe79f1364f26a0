"""The GB10 estimate: ms per token against the layer count, and the step split into the weight
bytes it reads and the rest, the bytes then read at the GB10's bandwidth."""

from __future__ import annotations

from lab.decode import model, stats


def step_bytes(expert_bytes: float, side_bytes: float, tokens: int = 1 + model.MTP) -> dict:
    """Weight bytes one decode step reads at concurrency 1 (an estimate for the GB10 line).

    Per layer: the side weights (`side_bytes` per parameter) and the routed experts of the step's
    `tokens` positions, TOPK each, counted as distinct (an upper bound; random weights route
    anywhere). Fixed: the lm_head once per forward (the verify pass and each draft pass: 1 + MTP
    reads, bf16) and the MTP layer for each draft (its experts fp8, one position each). KV cache,
    PLE rows and activations are left out: at 4k context they are megabytes against gigabytes."""
    expert = 3 * model.HIDDEN * model.MOE_INTER
    per_layer = model.SIDE_PARAMS * side_bytes + min(model.EXPERTS, model.TOPK * tokens) * expert * expert_bytes
    mtp_layer = model.SIDE_PARAMS * 2 + model.TOPK * expert * model.EXPERT_BYTES["fp8"]
    fixed = (1 + model.MTP) * model.VOCAB * model.HIDDEN * 2 + model.MTP * mtp_layer
    return {"per_layer": per_layer, "fixed": fixed}


# What the bench's checkpoint holds (--quant fp8: FP8_PB_WO experts, bf16 side layers) and what the
# recipe serves on a Spark (MODE=hybrid: NVFP4 experts, fp8 side layers)
BENCH_BYTES = step_bytes(model.EXPERT_BYTES["fp8"], 2.0)

RECIPE_BYTES = step_bytes(model.EXPERT_BYTES["nvfp4"], 1.0)


def extrapolate(summ: dict, layers: int = model.LAYERS, bw_h200_gbs: float | None = None, bw_gb10_gbs: float = 273.0,
                measured_bytes: dict = BENCH_BYTES, recipe_bytes: dict = RECIPE_BYTES) -> dict:
    """Per config, at concurrency 1: ms per decoded token against the layer count, a least-squares
    line through the measured counts, read at `layers` (an estimate: it assumes the per-layer cost
    is the same in every repeat of the pattern).

    With the H200's measured copy bandwidth, three GB10 figures, all estimates, per decode step
    (= per token at random weights' acceptance length 1; trained weights multiply them by theirs):
    - `gb10_tok_s_all_scaled`: the whole step time stretched by the bandwidth ratio: a floor, since
      most of an H200 step at batch 1 is not spent moving bytes;
    - `gb10_tok_s_estimate`: the step split into the weight bytes it reads (`measured_bytes`, at the
      H200's bandwidth) and the rest (launches, host work, latency), which is kept as measured;
      the bytes are then read at the GB10's bandwidth;
    - `gb10_tok_s_estimate_recipe_bytes`: the same with the recipe's own bytes (NVFP4 experts, fp8
      side layers) instead of the bench checkpoint's (fp8 experts, bf16 side layers)."""
    pts: dict = {}
    for series, by in summ.items():
        if "/L" not in series or not (by.get(1) or {}).get("per_stream_tok_s"):
            continue
        cfg, L = series.split("/L")
        pts.setdefault(cfg, []).append((int(L), 1000.0 / by[1]["per_stream_tok_s"]))
    out = {}
    for cfg, xy in pts.items():
        xy.sort()
        if len({x for x, _ in xy}) < 2:
            out[cfg] = {"points": xy, "note": "one layer count: no line to extrapolate"}
            continue
        a, b = stats.fit_line(xy)
        ms = a + b * layers
        row = {"points": xy, "ms_fixed": round(a, 3), "ms_per_layer": round(b, 4), f"ms_per_token_L{layers}": round(ms, 3),
               f"tok_s_L{layers}_h200_estimate": round(1000.0 / ms, 1)}
        if bw_h200_gbs:
            def read_ms(by: dict, gbs: float) -> float:
                return (by["fixed"] + layers * by["per_layer"]) / (gbs * 1e9) * 1000.0

            other = max(ms - read_ms(measured_bytes, bw_h200_gbs), 0.0)
            row |= {"gb10_tok_s_all_scaled": round(1000.0 / (ms * bw_h200_gbs / bw_gb10_gbs), 1),
                    "h200_ms_reading_weights": round(read_ms(measured_bytes, bw_h200_gbs), 3),
                    "ms_other": round(other, 3),
                    "gb10_tok_s_estimate": round(1000.0 / (other + read_ms(measured_bytes, bw_gb10_gbs)), 1),
                    "gb10_tok_s_estimate_recipe_bytes": round(1000.0 / (other + read_ms(recipe_bytes, bw_gb10_gbs)), 1)}
        out[cfg] = row
    return out


def gb10_band(step_ms_h200: float, step_bytes: dict, bw_h200_gbs: float, layers: int = model.LAYERS,
              bw_gb10_gbs: float = 273.0, bw_fraction: tuple[float, float] = (0.75, 1.0),
              other_factor: tuple[float, float] = (1.0, 2.0)) -> dict:
    """A GB10 decode step estimated from one measured at the real 48-layer shape on an H200 (no
    line through layer counts): the weight bytes the step reads (`step_bytes`, at the H200's
    measured bandwidth) are taken out, and what is left (launches, host work, latency, kernels that
    do not stream weights) is kept. The GB10 step is then those bytes at a fraction of its 273 GB/s
    (`bw_fraction`: no kernel reaches the peak) plus the rest stretched by `other_factor` (its GPU
    has about a third of the H200's SMs, its host is a Grace CPU). Both ranges are assumptions,
    so the band is theirs, not a statistical interval. Per step = per token at acceptance length 1."""
    read = (step_bytes["fixed"] + layers * step_bytes["per_layer"]) / 1e9  # GB
    other = step_ms_h200 - read / bw_h200_gbs * 1000.0
    if other < 0:
        raise ValueError(f"a {step_ms_h200} ms step cannot read {read:.1f} GB at {bw_h200_gbs} GB/s")
    slow = max(other_factor) * other + read / (min(bw_fraction) * bw_gb10_gbs) * 1000.0
    fast = min(other_factor) * other + read / (max(bw_fraction) * bw_gb10_gbs) * 1000.0
    return {"h200_step_ms": round(step_ms_h200, 3), "gb_read": round(read, 2), "h200_ms_other": round(other, 3),
            "gb10_step_ms": [round(fast, 1), round(slow, 1)],
            "gb10_tok_s_per_step": [round(1000.0 / slow, 1), round(1000.0 / fast, 1)],
            "assumed": {"bw_fraction": list(bw_fraction), "other_factor": list(other_factor), "bw_gb10_gbs": bw_gb10_gbs}}
