"""Patch 6 meets the writer: OUR tiny hybrids (flash prepare hybrid on tests/fakes/ckpt.py TINY
snapshots, both layouts, built by the outer test in the project venv and passed in
FLASH_TEST_TINY_HYBRIDS) dispatch through this release's real ModelOpt config.

For each variant's config.json quantization_config (what vLLM reads) and hf_quant_config.json:
vLLM picks MIXED_PRECISION, every converted module (fused as this release fuses them) gets the
FP8_PB_WO linear method, the NVFP4 experts stay NVFP4, and in_proj_ba stays unquantized. The
FP8_PB_WO method's registered `weight_scale` has the name and 4-D shape the writer put in the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from check_fp8_hybrid import _assert_fp8_pb_wo, _linear

LM = "model.language_model."
FUSED = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz", "q_proj": "qkv_proj", "k_proj": "qkv_proj",
         "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _variants() -> list[Path]:
    raw = os.environ.get("FLASH_TEST_TINY_HYBRIDS", "")
    return [Path(p) for p in raw.split(os.pathsep) if p]


@pytest.fixture(params=["radixark", "nvidia"])
def variant(request):
    hit = [p for p in _variants() if request.param in str(p).lower()]
    assert hit, (f"FLASH_TEST_TINY_HYBRIDS has no {request.param} hybrid ({_variants()}); "
                 "run through tests/vllm/test_releases.py, which builds them with flash prepare hybrid")
    return hit[0]


def _sections(var: Path) -> dict:
    cfg = json.loads((var / "config.json").read_text())
    hq = json.loads((var / "hf_quant_config.json").read_text())
    return {"config.json": cfg["quantization_config"], "hf_quant_config.json": hq}


@pytest.fixture()
def mapped(vllm_config):
    from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForCausalLM

    saved = vllm_config.model_config
    object.__setattr__(vllm_config, "model_config", SimpleNamespace(dtype=torch.bfloat16))
    try:
        yield Qwen4ExpForCausalLM
    finally:
        object.__setattr__(vllm_config, "model_config", saved)


def _config(q: dict, model):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig

    cfg = ModelOptMixedPrecisionConfig.from_config(q)
    cfg.packed_modules_mapping = dict(model.packed_modules_mapping)
    cfg.apply_vllm_mapper(model.hf_to_vllm_mapper)
    return cfg


def _vllm_prefixes(modules: list[str], packed: dict) -> set[str]:
    """Checkpoint module names → the prefixes this release builds linears for."""
    idx_fused = "indexer.index_qk_proj" in packed.get("qkv_proj", [])  # 0.32+
    out = set()
    for m in modules:
        m = "model." + m[len(LM):]
        base, _, leaf = m.rpartition(".")
        if leaf == "index_qk_proj":
            out.add(base[: -len(".indexer")] + ".qkv_proj" if idx_fused else m)
        else:
            out.add(f"{base}.{FUSED.get(leaf, leaf)}")
    return out


def test_release_reads_our_configs_as_mixed_precision(variant):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig

    q = _sections(variant)["config.json"]  # vLLM selects the method from config.json's quantization_config
    assert ModelOptMixedPrecisionConfig.override_quantization_method(q, None) == "modelopt_mixed"


def test_our_converted_layers_dispatch_fp8_pb_wo_and_experts_nvfp4(variant, mapped):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    wm = json.loads((variant / "model.safetensors.index.json").read_text())["weight_map"]
    modules = sorted(k[: -len(".weight_scale")] for k in wm if k.endswith(".weight_scale") and k.startswith(LM)
                     and ".mlp.experts." not in k and ".ple." not in k)
    assert len(modules) == json.loads((variant / ".prepared").read_text())["tensors"] > 0
    for where, q in _sections(variant).items():
        cfg = _config(q, mapped)
        prefixes = _vllm_prefixes(modules, cfg.packed_modules_mapping)
        for prefix in sorted(prefixes):
            _assert_fp8_pb_wo(cfg.get_quant_method(_linear(), prefix), cfg, f"{where}: {prefix}")
        layers = sorted({int(m.split(".")[3]) for m in modules})
        for i in layers:
            assert cfg._resolve_quant_algo(f"model.layers.{i}.mlp.experts") == "NVFP4", (where, i)
        gdn = next(p for p in prefixes if p.endswith("linear_attn.out_proj")).rsplit(".", 1)[0]
        assert isinstance(cfg.get_quant_method(_linear(), f"{gdn}.in_proj_ba"), UnquantizedLinearMethod), where


def test_fp8_pb_wo_method_registers_the_tensor_names_we_write(variant, mapped, monkeypatch):
    """create_weights of the dispatched method: `weight` F8 [N,K] and a `weight_scale` holding
    the [N/128, K/128] grid (registered 4-D [N/128,1,K/128,1] like the file, or 2-D with the same
    element count where the release reshapes on load); no `weight_scale_inv`."""
    from safetensors import safe_open

    wm = json.loads((variant / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(k for k in sorted(wm) if k.endswith("linear_attn.out_proj.weight_scale"))
    with safe_open(str(variant / wm[name]), "pt") as f:
        scale = f.get_slice(name).get_shape()
        weight = f.get_slice(name[: -len("_scale")]).get_shape()
    n, k = weight
    assert list(scale) == [n // 128, 1, k // 128, 1]
    cfg = _config(_sections(variant)["config.json"], mapped)
    prefix = "model." + name[len(LM): -len(".weight_scale")]
    method = cfg.get_quant_method(_linear(), prefix)
    import vllm.model_executor.parameter as vparam

    for fn, val in (("get_tensor_model_parallel_rank", 0), ("get_tensor_model_parallel_world_size", 1)):
        if hasattr(vparam, fn):  # no TP group on CPU: a single rank
            monkeypatch.setattr(vparam, fn, lambda v=val: v)
    layer = torch.nn.Module()
    try:
        method.create_weights(layer, input_size_per_partition=k, output_partition_sizes=[n], input_size=k,
                              output_size=n, params_dtype=torch.bfloat16, weight_loader=lambda *a, **kw: None)
    except ValueError as exc:  # 0.30+: the params are registered, then the GEMM kernel choice fails on CPU
        if "Failed to find a kernel" not in str(exc):
            raise
    params = dict(layer.named_parameters())
    assert params["weight"].dtype == torch.float8_e4m3fn and tuple(params["weight"].shape) == (n, k)
    assert "weight_scale" in params and "weight_scale_inv" not in params, sorted(params)
    got = tuple(params["weight_scale"].shape)
    assert got in ((n // 128, 1, k // 128, 1), (n // 128, k // 128)), got
