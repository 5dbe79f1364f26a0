"""The QAD export's layout (tests/fakes/ckpt.py flavour `qad`, built by the outer test and passed in
FLASH_TEST_QAD_SNAPSHOT) against this release's real loader classes: what flash's
checkpoint/known.py claims per release.

- every release reads its quantization_config as ModelOpt MIXED_PRECISION with the side layers
  (fused as the release fuses them) MXFP8 and the experts NVFP4;
- the release's own NVFP4 PLE method exists exactly from `known.LAYOUTS["qad"].stock_table_from`
  on (the preflight's gate), and there registers the tensors the fixture holds: `weight` U8
  [rows, w/2], `weight_scale` F8_E4M3 [rows, w/16], `weight_scale_2` F32;
- the MXFP8 linear method registers `weight` F8_E4M3 [N, K] and a U8 `weight_scale` [N, K/32],
  the fixture's names and shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from check_fp8_hybrid import _linear
from flash_common import releases
from flash_cli.checkpoint import known

LM = "model.language_model."
NGRAM = "model.layers.1.ple.ple_embedding.ngram_embedding"


@pytest.fixture(scope="module")
def cfg(snap):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig
    from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForCausalLM

    q = json.loads((snap / "config.json").read_text())["quantization_config"]
    assert ModelOptMixedPrecisionConfig.override_quantization_method(q, None) == "modelopt_mixed"
    c = ModelOptMixedPrecisionConfig.from_config(q)
    c.packed_modules_mapping = dict(Qwen4ExpForCausalLM.packed_modules_mapping)
    c.apply_vllm_mapper(Qwen4ExpForCausalLM.hf_to_vllm_mapper)
    return c


def _header(snap: Path, name: str) -> tuple[str, list[int]]:
    from flash_common.stheader import read_header

    wm = json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"]
    t = read_header(snap / wm[name]).tensors[name]
    return t.dtype, list(t.shape)


def _one_rank(monkeypatch):
    import vllm.model_executor.parameter as vparam

    for fn, val in (("get_tensor_model_parallel_rank", 0), ("get_tensor_model_parallel_world_size", 1)):
        if hasattr(vparam, fn):  # no TP group on CPU: a single rank
            monkeypatch.setattr(vparam, fn, lambda v=val: v)


@pytest.mark.parametrize("prefix, algo", [
    ("model.layers.0.linear_attn.in_proj_qkvz", "MXFP8"),
    ("model.layers.0.linear_attn.out_proj", "MXFP8"),
    ("model.layers.3.self_attn.qkv_proj", "MXFP8"),
    ("model.layers.2.mlp.shared_expert.gate_up_proj", "MXFP8"),
    ("model.layers.2.mlp.experts", "NVFP4"),
    (NGRAM, "NVFP4"),
])
def test_the_release_reads_the_export_as_mixed_precision(cfg, prefix, algo):
    assert cfg._resolve_quant_algo(prefix) == algo


def test_nvfp4_table_method_exists_from_the_release_known_py_names(cfg, snap, base, monkeypatch):
    import importlib

    try:  # 0.29 keeps the PLE embedding elsewhere (no common/ngram_embedding.py) and has no NVFP4 table
        ne = importlib.import_module("vllm.models.qwen4_exp.common.ngram_embedding")
    except ImportError:
        ne = None
    lay = known.LAYOUTS["qad"]
    expected = base in releases.upstream_from(lay.stock_table_from)
    assert hasattr(ne, "Qwen4ExpPLENvFp4EmbeddingMethod") == expected, (base, lay.stock_table_from)
    if not expected:
        return
    method = ne.Qwen4ExpPLEEmbeddingMethod.from_quant_config(cfg, NGRAM)
    assert type(method).__name__ == "Qwen4ExpPLENvFp4EmbeddingMethod"

    class Layer(torch.nn.Module):
        def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype):
            return torch.empty(num_embeddings, embedding_dim, dtype=dtype)

    dtype, shape = _header(snap, f"{LM}layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight")
    rows, half = shape
    _one_rank(monkeypatch)
    layer = Layer()
    method.create_weights(layer, 2 * half, [rows], 2 * half, rows, torch.bfloat16, weight_loader=lambda *a, **k: None)
    params = dict(layer.named_parameters())
    assert dtype == "U8" and params["weight"].dtype == torch.uint8 and params["weight"].shape[1] == half
    sdtype, sshape = _header(snap, f"{LM}layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight_scale")
    assert sdtype == "F8_E4M3" and params["weight_scale"].dtype == torch.float8_e4m3fn
    assert params["weight_scale"].shape[1] == sshape[1] == 2 * half // 16
    gdtype, _ = _header(snap, f"{LM}layers.1.ple.ple_embedding.ngram_embedding.weight_scale_2")
    assert gdtype == "F32" and params["weight_scale_2"].dtype == torch.float32


def test_mxfp8_method_registers_the_tensors_the_export_holds(cfg, snap, monkeypatch):
    name = f"{LM}layers.0.linear_attn.out_proj.weight"
    wdtype, (n, k) = _header(snap, name)
    sdtype, sshape = _header(snap, name + "_scale")
    assert (wdtype, sdtype, sshape) == ("F8_E4M3", "U8", [n, k // 32])
    try:
        method = cfg.get_quant_method(_linear(), "model.layers.0.linear_attn.out_proj")
    except ValueError as exc:  # 0.29 picks the GEMM kernel when it builds the method: none on CPU
        assert "MXFP8" in str(exc), exc  # ... but the dispatch was MXFP8's
        return
    _one_rank(monkeypatch)
    layer = torch.nn.Module()
    try:
        method.create_weights(layer, input_size_per_partition=k, output_partition_sizes=[n], input_size=k,
                              output_size=n, params_dtype=torch.bfloat16, weight_loader=lambda *a, **kw: None)
    except ValueError as exc:  # the params are registered, then the GEMM kernel choice fails on CPU
        if "kernel" not in str(exc).lower():
            raise
    params = dict(layer.named_parameters())
    assert params["weight"].dtype == torch.float8_e4m3fn and tuple(params["weight"].shape) == (n, k)
    assert params["weight_scale"].dtype == torch.uint8 and tuple(params["weight_scale"].shape) == (n, k // 32)
