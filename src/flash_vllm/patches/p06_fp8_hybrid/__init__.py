"""Patch 6: NVFP4 experts + fp8 side layers (the hybrid layout). Served natively: no code.

The hybrid step of the checkpoint pipeline writes the bf16 side layers (GDN in_proj_qkv /
in_proj_z / out_proj, QSA q/k/v/o, shared-expert gate/up/down) as float8_e4m3fn with one fp32
scale per 128x128 block. Written in ModelOpt's own convention (`weight` F8_E4M3 plus a 4-D fp32
`weight_scale` [out/128, 1, in/128, 1], and a `quantized_layers` entry `{"quant_algo":
"FP8_PB_WO"}` in a MIXED_PRECISION quant config), every supported release dispatches those
layers to its FP8_PB_WO linear method (0.29: `ModelOptFp8PbWoLinearMethod`; 0.30+: the generic
`ModelOptLinearMethod`) beside the NVFP4 experts. The upstream recipe's dispatch shim (scan the
safetensors for `weight_scale_inv`, hand those layers to `Fp8LinearMethod`) is therefore not
needed for that layout; the vllm tier proves the dispatch on each release with a synthetic
hybrid config (`tests/vllm/release/check_fp8_hybrid.py`). `VLLM_FP8_HYBRID` selects nothing in
the plugin; `VLLM_USE_DEEP_GEMM=0` is still passed by the run spec for the fp8 GEMMs.

Caveats the layout must respect (read from the releases): one algo per fused module (all shards
of in_proj_qkvz, qkv_proj, gate_up_proj), in_features % 128 == 0, and a `modelopt_fp4`
(non-mixed) config would have to become MIXED_PRECISION because `without_modelopt_fp4()` builds
QSA qkv unquantized for it. The `weight_scale_inv` (DeepSeek) convention is not served.
"""

from flash_common import releases

from ...registry import Context, Gate, Patch, TargetMissing, expect_source, source_of

GQM = ("vllm.model_executor.layers.quantization.modelopt", "ModelOptMixedPrecisionConfig.get_quant_method")


def upstream_check(ctx: Context) -> None:
    src = source_of(*GQM)
    if "FP8_PB_WO" in src:  # 0.29: explicit branch
        expect_source(*GQM, 'if quant_algo == "FP8_PB_WO":', "ModelOptFp8PbWoLinearMethod(")
        return
    expect_source(*GQM, "LINEAR_ALGOS", "build_linear_method(")  # 0.30+: generic method
    import vllm.model_executor.layers.quantization.modelopt as m

    if "FP8_PB_WO" not in getattr(m, "LINEAR_ALGOS", {}):
        raise TargetMissing("modelopt.LINEAR_ALGOS has no FP8_PB_WO")


PATCH = Patch(
    number=6,
    name="fp8-hybrid",
    title="NVFP4 experts + fp8 (128x128 block) side layers",
    why=("The hybrid checkpoint keeps NVFP4 experts and stores the bf16 side layers in fp8. In "
         "ModelOpt's FP8_PB_WO convention under a MIXED_PRECISION config vLLM dispatches them "
         "natively on every supported release, so no dispatch shim ships."),
    upstream="native ModelOpt MIXED_PRECISION FP8_PB_WO dispatch (0.29.0+)",
    gate=Gate("VLLM_FP8_HYBRID", "VLLM_FP8_HYBRID=1 (informational; nothing to switch)"),
    targets=(":".join(GQM),),
    upstream_in=releases.upstream_from("0.29.0"),
    upstream_check=upstream_check,
    untraced={"VLLM_FP8_HYBRID": "informational: patch 6 ships no code (the checkpoint's quant config decides)"},
)
