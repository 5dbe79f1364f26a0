"""Patch 1's NVFP4 table codec (flash_vllm/ple/nvfp4.py) against vLLM's own NVFP4 PLE lookups, on CPU.

On releases with `Qwen4ExpPLENvFp4EmbeddingMethod` (known.LAYOUTS["qad"].stock_table_from on):
- the QAD fixture's table (tests/fakes/ckpt.py `qad`, FLASH_TEST_QAD_SNAPSHOT), every row, read by
  our engine from disk and decoded by our Decoder, equals the method's own `embedding()` lookup
  (its CPU path, `dequantize_to_dtype`) bit for bit;
- the same rows, and rows holding every code byte and every scale byte (NaN scales included) under
  ordinary, overflowing, infinite and NaN global scales, equal the method's CUDA kernel
  (`_lookup_nvfp4_ple_embedding_kernel`, what serves on a GPU) run by Triton's interpreter on CPU,
  in float32 (the interpreter's bf16 store truncates; the test says why);
- patch 1 applies with an NVFP4 table: the release's `Qwen4ExpNGramEmbedding` built with the patch
  has its codes and block scales on `meta`, loads `weight_scale_2` through the stock loader, and its
  forward equals the unpatched layer's (device table) bit for bit on what the runner hands it.
On the releases before it: no NVFP4 method, and patch 1 (0.30-0.32) refuses an NVFP4 table on disk
that the release's method did not read, naming both.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from check_ple_mmap_forward import hf_config  # noqa: F401 - the release's text config, as a fixture here
from check_ple_mmap_forward import HEAD_DIM, write_release_table
from check_ple_mmap_forward import _storage_base as _storage
from flash_common import releases
from flash_cli.checkpoint import known

COMMON = "vllm.models.qwen4_exp.common.ngram_embedding"
NGRAM = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
LM = "model.language_model."
TABLE = f"{LM}layers.1.ple.ple_embedding.ngram_embedding."


def _has_method(base) -> bool:
    """Whether this release has vLLM's NVFP4 table method (asserted against the catalogue's claim)."""
    try:
        ne = importlib.import_module(COMMON)
    except ImportError:
        ne = None
    have = hasattr(ne, "Qwen4ExpPLENvFp4EmbeddingMethod")
    assert have == (base in releases.upstream_from(known.LAYOUTS["qad"].stock_table_from)), base
    return have


def _fixture_tensors(snap: Path) -> dict:
    """The fixture's table tensors as torch tensors (safetensors' torch loader reads F8)."""
    from safetensors import safe_open

    wm = json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, fname in wm.items():
        if name.startswith(TABLE):
            with safe_open(str(snap / fname), "pt") as f:
                out[name[len(TABLE):]] = f.get_tensor(name)
    return out


def _vllm_layer(t: dict, shards: int):
    """What `Qwen4ExpPLENvFp4EmbeddingMethod.embedding` reads from its layer: the whole table."""
    weight = torch.cat([t[f"shard_{k}.weight"] for k in range(shards)])
    return SimpleNamespace(weight=weight, weight_scale=torch.cat([t[f"shard_{k}.weight_scale"] for k in range(shards)]),
                           weight_scale_2=t["weight_scale_2"].reshape(1).float(), params_dtype=torch.bfloat16,
                           embedding_dim=weight.shape[1] * 2)


def _ours(snap, ids, dtype=torch.bfloat16):
    from flash_vllm.ple import Stager, open_table

    table = open_table(snap, layer=1)
    assert table.dtype == "NVFP4"
    return table, Stager(table, "cpu", out_dtype=dtype).lookup(ids)


def test_codec_equals_the_releases_cpu_lookup_on_the_qad_fixture(snap, base):
    if not _has_method(base):
        return
    ne = importlib.import_module(COMMON)
    t = _fixture_tensors(snap)
    shards = sum(1 for k in t if k.endswith(".weight") and k.startswith("shard_"))
    layer = _vllm_layer(t, shards)
    table, _ = _ours(snap, np.zeros(1, np.int64))
    assert table.num_rows == layer.weight.shape[0] and table.head_dim == layer.embedding_dim
    ids = torch.arange(table.num_rows, dtype=torch.int64).reshape(-1, 16)  # every row, 16 heads a token
    want = ne.Qwen4ExpPLENvFp4EmbeddingMethod().embedding(layer, ids)
    _, got = _ours(snap, ids.numpy())
    assert want.dtype == got.dtype == torch.bfloat16 and want.shape == got.shape == (*ids.shape, layer.embedding_dim)
    assert not want.isnan().any() and want.abs().max() > 0  # the fixture's scales are finite: a real comparison
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


_KERNEL_RUN = r"""
import sys, torch
from vllm.models.qwen4_exp.common import ngram_embedding as ne
from vllm.triton_utils import HAS_TRITON
assert HAS_TRITON, "Triton is not active: the interpreter run needs CUDA_VISIBLE_DEVICES='' (vLLM's lenient check)"
cases = torch.load(sys.argv[1])
out = []
for weight, scale, g in cases:
    n, d = weight.shape[0], weight.shape[1] * 2
    res = torch.empty(n, d, dtype=torch.float32)  # see the test: the interpreter truncates bf16 stores
    ids = torch.arange(n, dtype=torch.int64)
    ne._lookup_nvfp4_ple_embedding_kernel[(n,)](weight, scale, g, ids, res, d, 0, n, BLOCK_D=d)
    out.append(res)
torch.save(out, sys.argv[2])
"""


def test_codec_equals_the_releases_cuda_kernel_under_the_triton_interpreter(snap, base, tmp_path):
    """vLLM's GPU lookup (the one our decode replaces when serving), run by Triton's interpreter.

    Compared in float32, before the one rounding to the model's dtype: the interpreter stores
    float32 to a bf16 pointer by truncation (measured: 3,285 of 8,192 fixture values 1 ulp off
    toward zero), where a GPU's store rounds to nearest even like torch's `.to(bfloat16)`. That
    last rounding is left to the GPU tiers."""
    if not _has_method(base):
        return
    from flash_vllm.ple.nvfp4 import Decoder

    t = _fixture_tensors(snap)
    shards = sum(1 for k in t if k.endswith(".weight") and k.startswith("shard_"))
    fx = _vllm_layer(t, shards)
    i = torch.arange(256)
    every = ((i[:, None] + torch.arange(16)[None, :] * 17) % 256).to(torch.uint8)  # every code byte, 32 values
    every_scale = torch.stack([i, (i * 7 + 3) % 256], 1).to(torch.uint8)  # every E4M3 byte, 0x7F/0xFF NaN
    cases = [(fx.weight, fx.weight_scale.view(torch.uint8), fx.weight_scale_2)]
    for g in (0.7, 2.0 ** -20, 3.0e38, float("inf"), float("nan"), 0.0, -1.5):
        cases.append((every, every_scale, torch.tensor([g], dtype=torch.float32)))
    src, dst = tmp_path / "cases.pt", tmp_path / "out.pt"
    torch.save(cases, src)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _KERNEL_RUN, str(src), str(dst)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernel = torch.load(dst)
    for (weight, scale, g), want in zip(cases, kernel):
        rows = torch.cat([weight, scale], dim=1)
        got = Decoder("cpu", weight.shape[1], float(g)).decode(rows)
        assert got.dtype == want.dtype == torch.float32
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), float(g)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), float(g)
    assert kernel[0].abs().max() > 0 and kernel[4].isinf().any() and kernel[5].isnan().all()  # the cases bite


# --- patch 1 through the release's layer -------------------------------------------------------------

@pytest.fixture(scope="module")
def nvfp4_ckpt(tmp_path_factory):
    """An NVFP4 table (finite block scales) with the hash buffers the release computes."""
    return write_release_table(tmp_path_factory.mktemp("ple-nvfp4"), dtype="NVFP4", scale=0.0625 * 0.7, finite=True)


@pytest.fixture(scope="module")
def nvfp4_layers(base, request, tmp_path_factory, cpu_world, restore_ple_storage):
    """(stock, patched) `Qwen4ExpNGramEmbedding` over the NVFP4 table, or the old release's refusal."""
    if not _storage(base):  # 0.29: the splitting-op flavour refuses NVFP4 tables in its own check
        yield None
        return
    from check_ple_mmap_forward import PREFIX
    from flash_vllm import compat
    from flash_vllm.patches import p01_ple_mmap as ple_mmap
    from flash_vllm.registry import Context, original

    hf_config = request.getfixturevalue("hf_config")
    ck = request.getfixturevalue("nvfp4_ckpt")
    have = _has_method(base)
    cfg_nv = copy.deepcopy(hf_config)
    cfg_nv.ple_embedding_dtype = "nvfp4" if have else "float8_e4m3fn"
    ng = importlib.import_module(NGRAM)
    stock_classes = tuple(original(c) for c in (ng.Qwen4ExpPLEPinnedHostEmbedding, ng.Qwen4ExpPLEDeviceEmbedding))
    ng.Qwen4ExpPLEPinnedHostEmbedding, ng.Qwen4ExpPLEDeviceEmbedding = stock_classes
    with cpu_world(tmp_path_factory, ck.dir) as cfg:
        if getattr(cfg, "engram_config", None) is not None:
            cfg.engram_config.cpu_offload = False

        def build(load=True):
            m = ng.Qwen4ExpNGramEmbedding(cfg_nv, 16 * HEAD_DIM, 0, 64, data_parallel_rank=0, prefix=PREFIX,
                                          quant_config=None, params_dtype=torch.bfloat16)
            if load:
                m.load_weights(list(ck.tensors.items()))
            return m

        try:
            stock = build() if have else None
            ctx = Context(compat.resolve(compat.installed_vllm_version(), {}), {"VLLM_PLE_MMAP": "1"})
            ple_mmap.check(ctx)
            ple_mmap.apply(ctx)
            ours = build(load=have)  # an FP8 method cannot even load the NVFP4 shards (shape check)
            assert type(ours.ngram_embedding).__name__.startswith("FlashMmap")
            yield SimpleNamespace(stock=stock, ours=ours, ckpt=ck, have=have)
        finally:
            restore_ple_storage(ng, stock_classes)


def test_patch1_keeps_codes_and_block_scales_on_disk(nvfp4_layers, base):
    if nvfp4_layers is None:
        assert not _storage(base)
        return
    emb = nvfp4_layers.ours.ngram_embedding
    if not nvfp4_layers.have:
        assert type(emb.embedding_method).__name__ == "Qwen4ExpPLEFp8EmbeddingMethod"
        with pytest.raises(ValueError, match="NVFP4 on disk but vLLM chose Qwen4ExpPLEFp8EmbeddingMethod"):
            emb.stager(torch.device("cpu"))
        return
    assert type(emb.embedding_method).__name__ == "Qwen4ExpPLENvFp4EmbeddingMethod"
    rows = nvfp4_layers.ckpt.rows
    assert emb.weight.is_meta and tuple(emb.weight.shape) == (rows, HEAD_DIM // 2) and emb.weight.dtype == torch.uint8
    assert emb.weight_scale.is_meta and tuple(emb.weight_scale.shape) == (rows, HEAD_DIM // 16)
    assert emb.weight_scale.dtype == torch.float8_e4m3fn
    # the one global scale is a real parameter, loaded by the stock loader, and equals what our
    # engine read from the header (the value the decoder multiplies by)
    g = nvfp4_layers.ckpt.tensors["ngram_embedding.weight_scale_2"]
    assert not emb.weight_scale_2.is_meta and torch.equal(emb.weight_scale_2.reshape(-1), g.reshape(-1))
    emb.embedding_method.process_weights_after_loading(emb)  # the release's own "scale loaded" check
    assert emb.stager(torch.device("cpu")).table.global_scale == float(g.reshape(-1)[0])
    stock = nvfp4_layers.stock.ngram_embedding
    assert not stock.weight.is_meta and not stock.weight_scale.is_meta  # the stock side holds the table


@pytest.mark.parametrize("case", ["profile-run", "prefill-chunks", "decode", "mtp-verify", "prefill-distinct"])
def test_patched_nvfp4_forward_equals_the_releases(nvfp4_layers, base, case):
    if nvfp4_layers is None or not nvfp4_layers.have:
        assert not _storage(base) or not _has_method(base)
        return
    from check_ple_mmap_forward import CASES, _runner_inputs

    lens, contexts = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    ids, qsl, ctx = _runner_inputs(lens, max_reqs=16, contexts=contexts, gen=gen)
    hs = torch.zeros(sum(lens), 64, dtype=torch.bfloat16)
    stock, ours = nvfp4_layers.stock, nvfp4_layers.ours
    want = stock.ngram_embedding.dequantize(stock(hs, ids, qsl, ctx), torch.bfloat16)
    got = ours.ngram_embedding.dequantize(ours(hs, ids, qsl, ctx), torch.bfloat16)
    assert got.shape == want.shape == (sum(lens), 16 * HEAD_DIM)
    assert want.abs().max() > 0 and not want.isnan().any()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
