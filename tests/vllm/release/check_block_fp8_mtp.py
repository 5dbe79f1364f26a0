"""Patch 11: NVIDIA's block-FP8 MTP expert entries resolve on every release (0.29 by our backport).

NVIDIA's NVFP4 export: routed experts NVFP4, MTP experts `FP8_BLOCK_SCALES` (hf_quant_config)
or `FP8_PB_WO` (config.json), group 128. The drafter sees checkpoint `mtp.layers.0` as layer 48.
"""

from __future__ import annotations

import pytest

from flash_vllm.registry import by_number

NUM_LAYERS = 48


def nvidia_config(algo: str) -> dict:
    return {"quantization": {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": [],
        "quantized_layers": {
            "model.language_model.layers.0.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16},
            "mtp.layers.0.mlp.experts": {"quant_algo": algo, "group_size": 128},
            "mtp.layers.0.mlp.shared_expert.down_proj": {"quant_algo": "FP8"},
        }}}


def _remap(layers: dict) -> dict:
    from vllm.models.qwen4_exp.nvidia import mtp

    if hasattr(mtp, "_remap_quantized_layers"):  # 0.30+: upstream
        return mtp._remap_quantized_layers(layers, NUM_LAYERS)
    from flash_vllm.patches.p11_block_fp8_mtp import remap_quantized_layers

    return remap_quantized_layers(layers, NUM_LAYERS)


@pytest.mark.parametrize("algo", ["FP8_BLOCK_SCALES", "FP8_PB_WO"])
def test_mtp_experts_get_the_block_fp8_moe_method(registered, base, algo, monkeypatch):
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.quantization import fp8, modelopt

    cfg = modelopt.ModelOptMixedPrecisionConfig.from_config(nvidia_config(algo))
    assert cfg.fp8_block_config.weight_block_size == [128, 128]
    assert cfg.has_blocked_weights()
    cfg.quantized_layers = _remap(cfg.quantized_layers)
    assert "mtp.layers.48.mlp.experts" in cfg.quantized_layers or \
        "model.layers.48.mlp.experts" in cfg.quantized_layers

    made = []

    class Recorder:  # stands in for Fp8MoEMethod's constructor (it needs a built MoE layer)
        def __init__(self, quant_config, layer):
            made.append((quant_config, layer))

    monkeypatch.setattr(fp8, "Fp8MoEMethod", Recorder)
    monkeypatch.setattr(modelopt, "Fp8MoEMethod", Recorder, raising=False)
    experts = object.__new__(RoutedExperts)
    prefix = next(k for k in cfg.quantized_layers if k.endswith("48.mlp.experts"))
    method = cfg.get_quant_method(experts, prefix)
    assert isinstance(method, Recorder)
    assert made[0][0] is cfg.fp8_block_config and made[0][1] is experts
    if by_number(11).expected_status(base) == "applies":
        assert type(cfg).get_quant_method.__flash_patch__ == 11


def test_mixed_group_sizes_are_refused(registered):
    from vllm.model_executor.layers.quantization import modelopt

    cfg = nvidia_config("FP8_BLOCK_SCALES")
    cfg["quantization"]["quantized_layers"]["mtp.layers.0.mlp.experts2"] = \
        {"quant_algo": "FP8_BLOCK_SCALES", "group_size": 64}
    with pytest.raises(ValueError, match="group_size"):
        modelopt.ModelOptMixedPrecisionConfig.from_config(cfg)


def test_draft_config_remap_is_wired(registered, base):
    from vllm.models.qwen4_exp.nvidia import mtp
    import inspect

    fn = mtp._make_draft_vllm_config
    if by_number(11).expected_status(base) == "applies":
        assert fn.__flash_patch__ == 11
    else:
        assert "_remap_quantized_layers(" in inspect.getsource(fn)
