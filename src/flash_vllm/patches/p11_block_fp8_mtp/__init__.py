"""Patch 11: block-FP8 MTP experts in ModelOpt MIXED_PRECISION checkpoints (backport, 0.29).

NVIDIA's NVFP4 export keeps the MTP drafter's routed experts in block FP8 (`FP8_BLOCK_SCALES`
in hf_quant_config.json, `FP8_PB_WO` in config.json; `weight_scale_inv` tensors). 0.29's mixed
config has no MoE method for them (the experts are built unquantized and loading dies on
`w2_weight_scale_inv`), and `_make_draft_vllm_config` remaps `ignored_layers`/`exclude_modules`
to the drafter's layer index but not `quantized_layers`, so even a dispatch fix misses the MTP
prefixes. vllm#55513 fixed both in 0.30; this is its behaviour, by delegation:

- `ModelOptMixedPrecisionConfig.__init__`: also build `fp8_block_config`, an `Fp8Config` with
  the block-FP8 layers' (single) group size; `has_blocked_weights()` reports it.
- `get_quant_method`: routed experts whose algo is block FP8 get `Fp8MoEMethod`.
- `mtp._make_draft_vllm_config`: remap `quantized_layers` like the ignored layers.
"""

from __future__ import annotations

from flash_common import releases

from ...registry import Context, Gate, Patch, TargetMissing, expect_absent, expect_installed, \
    expect_source, install

NUMBER = 11
MODELOPT = "vllm.model_executor.layers.quantization.modelopt"
MTP = "vllm.models.qwen4_exp.nvidia.mtp"
INIT = (MODELOPT, "ModelOptMixedPrecisionConfig.__init__")
GQM = (MODELOPT, "ModelOptMixedPrecisionConfig.get_quant_method")
DRAFT = (MTP, "_make_draft_vllm_config")
BLOCK_FP8_MOE_ALGOS = ("FP8_PB_WO", "FP8_BLOCK_SCALES")


def block_group_size(quantized_layers: dict) -> int:
    sizes = {int(info.get("group_size", 128)) for info in quantized_layers.values()
             if str(info.get("quant_algo", "")).upper() in BLOCK_FP8_MOE_ALGOS}
    if len(sizes) > 1:
        raise ValueError("MIXED_PRECISION requires all block-FP8 MoE layers to use one "
                         f"group_size, got {sorted(sizes)}")
    return next(iter(sizes), 128)


def _init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config

        bs = block_group_size(self.quantized_layers or {})
        self.fp8_block_config = Fp8Config(is_checkpoint_fp8_serialized=True,
                                          activation_scheme="dynamic", weight_block_size=[bs, bs])

    __init__.__doc__ = orig.__doc__
    return __init__


def _has_blocked_weights(self) -> bool:
    return any(str(info.get("quant_algo", "")).upper() in BLOCK_FP8_MOE_ALGOS
               for info in (self.quantized_layers or {}).values())


def _gqm(orig):
    import vllm.model_executor.layers.quantization.modelopt as m

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, m.RoutedExperts) and not self.is_layer_excluded(prefix):
            algo = self._resolve_quant_algo(prefix)
            if algo is not None and algo.upper() in BLOCK_FP8_MOE_ALGOS:
                from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

                return Fp8MoEMethod(self.fp8_block_config, layer)
        return orig(self, layer, prefix)

    get_quant_method.__doc__ = orig.__doc__
    return get_quant_method


def remap_quantized_layers(quantized_layers: dict, mtp_start_layer_idx: int) -> dict:
    from vllm.models.qwen4_exp.nvidia import mtp

    return {mtp._remap_ignored_layers([name], mtp_start_layer_idx)[0]: info
            for name, info in quantized_layers.items()}


def _draft(orig):
    def _make_draft_vllm_config(vllm_config, mtp_start_layer_idx):
        draft = orig(vllm_config, mtp_start_layer_idx)
        qc = draft.quant_config
        layers = getattr(qc, "quantized_layers", None)
        if layers:
            qc.quantized_layers = remap_quantized_layers(layers, mtp_start_layer_idx)
        return draft

    _make_draft_vllm_config.__doc__ = orig.__doc__
    return _make_draft_vllm_config


def check(ctx: Context) -> None:
    expect_source(*INIT, "self.quantized_layers = quantized_layers")
    expect_source(*GQM, "isinstance(layer, RoutedExperts)", "self._resolve_quant_algo(prefix)")
    expect_absent(*GQM, "_BLOCK_FP8_MOE_ALGOS")
    expect_source(*DRAFT, "_remap_ignored_layers(", "draft_vllm_config.quant_config = draft_quant_config")
    expect_absent(*DRAFT, "quantized_layers")


def apply(ctx: Context) -> None:
    install(NUMBER, *INIT, _init)
    install(NUMBER, *GQM, _gqm)
    install(NUMBER, *DRAFT, _draft)
    import vllm.model_executor.layers.quantization.modelopt as m

    cls = m.ModelOptMixedPrecisionConfig
    if "has_blocked_weights" not in cls.__dict__:
        _has_blocked_weights.__flash_patch__ = NUMBER
        cls.has_blocked_weights = _has_blocked_weights


def verify(ctx: Context) -> None:
    for target in (INIT, GQM, DRAFT):
        expect_installed(NUMBER, *target)
    import vllm.model_executor.layers.quantization.modelopt as m

    if getattr(m.ModelOptMixedPrecisionConfig.has_blocked_weights, "__flash_patch__", None) != NUMBER:
        raise TargetMissing("ModelOptMixedPrecisionConfig.has_blocked_weights is not ours")


def upstream_check(ctx: Context) -> None:
    expect_source(*GQM, "_BLOCK_FP8_MOE_ALGOS", "Fp8MoEMethod(self.fp8_block_config, layer)")
    expect_source(*DRAFT, "_remap_quantized_layers(")


PATCH = Patch(
    number=NUMBER,
    name="block-fp8-mtp",
    title="Block-FP8 MTP experts in ModelOpt mixed checkpoints (backport of vllm#55513)",
    why=("0.29 cannot load NVIDIA's NVFP4 checkpoint with MTP: the drafter's block-FP8 experts "
         "have no MoE method and their quantized_layers entries are not remapped to the "
         "drafter's layer index."),
    upstream="vllm#55513 (merged 2026-09-08, in 0.30.0)",
    gate=Gate.always("always on for v0.29"),
    targets=tuple(f"{m}:{q}" for m, q in (INIT, GQM, DRAFT)),
    applies_to=releases.span("0.29.0", until="0.30.0"),
    upstream_in=releases.upstream_from("0.30.0"),
    check=check, apply=apply, verify=verify, upstream_check=upstream_check,
)
