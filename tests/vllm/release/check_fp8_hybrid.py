"""Patch 6 (no code): the release's ModelOpt mixed config dispatches a synthetic hybrid checkpoint.

The hybrid layout keeps NVFP4 experts and stores the side layers as FP8_PB_WO (fp8 weight +
4-D fp32 block scale) under MIXED_PRECISION. For each converted layer (fused modules included)
vLLM must pick its FP8_PB_WO linear method; untouched layers stay unquantized; experts NVFP4.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

FP8 = {"quant_algo": "FP8_PB_WO"}
SIDE = [
    "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
    "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
]
QSA = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]


def hybrid_quant_config() -> dict:
    layers = {}
    for i in (0, 1, 2):  # GDN layers
        for name in SIDE:
            layers[f"model.language_model.layers.{i}.{name}"] = dict(FP8)
        layers[f"model.language_model.layers.{i}.mlp.experts"] = {"quant_algo": "NVFP4", "group_size": 16}
    for name in QSA + SIDE[3:]:  # a QSA layer
        layers[f"model.language_model.layers.3.{name}"] = dict(FP8)
    return {"producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                             "exclude_modules": ["lm_head"], "quantized_layers": layers}}


@pytest.fixture()
def config(vllm_config):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig
    from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForCausalLM

    cfg = ModelOptMixedPrecisionConfig.from_config(hybrid_quant_config())
    cfg.packed_modules_mapping = dict(Qwen4ExpForCausalLM.packed_modules_mapping)
    cfg.apply_vllm_mapper(Qwen4ExpForCausalLM.hf_to_vllm_mapper)
    # the linear methods read the served dtype from the current config's model_config
    saved = vllm_config.model_config
    object.__setattr__(vllm_config, "model_config", SimpleNamespace(dtype=torch.bfloat16))
    try:
        yield cfg
    finally:
        object.__setattr__(vllm_config, "model_config", saved)


def _linear():
    from vllm.model_executor.layers.linear import ReplicatedLinear

    return object.__new__(ReplicatedLinear)


def _assert_fp8_pb_wo(method, cfg, prefix):
    name = type(method).__name__
    if name == "ModelOptFp8PbWoLinearMethod":  # 0.29
        return
    assert name == "ModelOptLinearMethod", f"{prefix}: {name}"
    from vllm.model_executor.layers.quantization import modelopt

    spec, _, _ = modelopt.resolve("FP8_PB_WO", cfg.fp8_config, prefix)
    assert method.spec == spec, f"{prefix}: {method.spec} is not the FP8_PB_WO spec"


@pytest.mark.parametrize("prefix", [
    "model.layers.0.linear_attn.in_proj_qkvz",   # fused: in_proj_qkv + in_proj_z
    "model.layers.0.linear_attn.out_proj",
    "model.layers.2.mlp.shared_expert.gate_up_proj",  # fused: gate + up
    "model.layers.2.mlp.shared_expert.down_proj",
    "model.layers.3.self_attn.qkv_proj",          # fused: q + k + v
    "model.layers.3.self_attn.o_proj",
])
def test_converted_side_layers_dispatch_to_fp8(config, prefix):
    _assert_fp8_pb_wo(config.get_quant_method(_linear(), prefix), config, prefix)


def test_unconverted_layers_stay_unquantized(config):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    for prefix in ("model.layers.0.linear_attn.in_proj_ba", "model.layers.5.linear_attn.out_proj"):
        assert isinstance(config.get_quant_method(_linear(), prefix), UnquantizedLinearMethod)


def test_experts_resolve_nvfp4(config):
    assert config._resolve_quant_algo("model.layers.0.mlp.experts") == "NVFP4"
    assert config._resolve_quant_algo("model.layers.0.linear_attn.in_proj_qkvz") == "FP8_PB_WO"


def test_patch_6_ships_no_code(registered):
    from flash_vllm.registry import by_number

    p = by_number(6)
    assert not p.applies_to and 6 not in registered["applied"]
