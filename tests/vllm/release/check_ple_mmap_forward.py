"""Patch 1 through the layer that calls it: the release's own `Qwen4ExpNGramEmbedding`, on CPU.

The older checks (check_ple_mmap.py) fed the replaced storage class ids we made ourselves. Here the
release's n-gram layer is built twice from one `Qwen4ExpTextConfig` — once with the stock device
storage class, once with patch 1 applied — loads the same checkpoint tensors through its own
`load_weights` (fp8 shards, weight_scale and the three I64 hash buffers), and runs `forward` on
what the model runner hands it: an int32 `query_start_loc` padded with trailing zero-length
requests up to `max_num_reqs` (the profile run's shape), an int32 `ngram_context` with one row per
request slot, token ids with EOS inside, several requests, a prefill chunk and decode steps. The
dequantised outputs must be bit-identical, and `VLLM_PLE_MMAP_DEBUG`'s host reference must find
every id in range.

0.29 has its own flavour (a splitting op inside the release's layer) and is driven through its
real forward in check_ple_mmap.py.
"""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest
import torch

NGRAM = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
PREFIX = "model.language_model.layers.1.ple.ple_embedding"
EOS, VOCAB, BASE, HEADS_PER, PARTS, HEAD_DIM = 511, 512, 20000, 8, 4, 16  # BASE: few collisions


def _storage_base(base):
    from flash_vllm.patches import p01_ple_mmap as ple_mmap

    return ple_mmap.FLAVOURS.get(base) == "storage"


@pytest.fixture(scope="module")
def hf_config():
    from transformers import Qwen4ExpTextConfig

    cfg = Qwen4ExpTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, hc_count=4, hc_lowrank=16,
        ple_layer_ids=[2], ple_embed_dim=16 * HEAD_DIM, heads_per_ngram=HEADS_PER, ngram_vocab_size_base=BASE,
        make_ngram_vocab_size_divisible_by=16, split_ngram_parts=PARTS, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=32, indexer_budget=2048, indexer_compress_ratio=4, eos_token_id=EOS,
        partial_rotary_factor=0.25)
    cfg.ple_embedding_dtype = "float8_e4m3fn"
    return cfg


def write_release_table(d, **synth_kw) -> SimpleNamespace:
    """A one-PLE-layer checkpoint in NVIDIA's layout under ``d``, with the hash buffers this release's
    layer computes for the tiny shape; ``synth_kw`` picks the table's dtype and scale (fp8 by
    default). Shared with check_ple_nvfp4.py."""
    from safetensors import safe_open

    from flash_vllm.ple import synth

    ng = importlib.import_module(NGRAM).Qwen4ExpNGramEmbedding
    sizes, offsets, total = ng._make_vocab_layout(ngram_vocab_size_base=BASE, ngram_heads=2 * HEADS_PER,
                                                  ple_dense_layer_id=0)
    mult = ng._make_layer_multipliers(ngram_size=3, unigram_vocab_size=VOCAB, seed=1234, ple_dense_layer_id=0)
    padded = -(-total // 16) * 16
    rps = -(-padded // PARTS)
    (fname,) = [f for f in synth.write_checkpoint(
        d, layout="nvidia", rows_per_shard=rps, num_shards=PARTS, last_rows=padded - (PARTS - 1) * rps,
        width=HEAD_DIM, buffers={"layer_multipliers": mult, "ngram_heads_offsets": offsets,
                                 "ngram_heads_vocab_sizes": sizes}, **synth_kw) if "ple" in f]
    tensors = {}
    with safe_open(os.path.join(d, fname), "pt") as f:
        for k in f.keys():
            if k.startswith(PREFIX + "."):
                tensors[k[len(PREFIX) + 1:]] = f.get_tensor(k)
    return SimpleNamespace(dir=d, tensors=tensors, rows=padded)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-PLE-layer checkpoint in NVIDIA's layout with the hash buffers vLLM computes."""
    return write_release_table(tmp_path_factory.mktemp("ple-fwd"))


@pytest.fixture(scope="module")
def layers(base, request, tmp_path_factory, cpu_world, restore_ple_storage):
    """(stock, patched) `Qwen4ExpNGramEmbedding`, both loaded from the checkpoint."""
    if not _storage_base(base):  # 0.29 has no nvidia/ngram_embedding module (its own flavour)
        yield None
        return
    hf_config, checkpoint = request.getfixturevalue("hf_config"), request.getfixturevalue("checkpoint")
    from flash_vllm import compat
    from flash_vllm.patches import p01_ple_mmap as ple_mmap
    from flash_vllm.registry import Context, original

    ng = importlib.import_module(NGRAM)
    # the release's own classes, even when an earlier check of this session left patch 1 bound
    # (check_ple_mmap.py did: the "stock" side was then patch 1 too, and a permuted gather passed)
    stock_classes = tuple(original(c) for c in (ng.Qwen4ExpPLEPinnedHostEmbedding, ng.Qwen4ExpPLEDeviceEmbedding))
    ng.Qwen4ExpPLEPinnedHostEmbedding, ng.Qwen4ExpPLEDeviceEmbedding = stock_classes
    with cpu_world(tmp_path_factory, checkpoint.dir) as cfg:
        if getattr(cfg, "engram_config", None) is not None:
            cfg.engram_config.cpu_offload = False  # stock: the device class (pinned needs UVA, no CPU)

        def build():
            m = ng.Qwen4ExpNGramEmbedding(hf_config, 16 * HEAD_DIM, 0, 64, data_parallel_rank=0, prefix=PREFIX,
                                          quant_config=None, params_dtype=torch.bfloat16)
            m.load_weights(list(checkpoint.tensors.items()))
            return m

        try:
            stock = build()
            ctx = Context(compat.resolve(compat.installed_vllm_version(), {}),
                          {"VLLM_PLE_MMAP": "1", "VLLM_PLE_MMAP_DEBUG": "1"})
            ple_mmap.check(ctx)
            ple_mmap.apply(ctx)
            ours = build()
            # each side is what it claims: an earlier check that left the release patched would
            # make this a comparison of patch 1 with itself
            assert type(stock.ngram_embedding) is stock_classes[1], type(stock.ngram_embedding)
            assert not getattr(stock_classes[1], "__flash_patch__", None)
            assert type(ours.ngram_embedding).__name__.startswith("FlashMmap"), type(ours.ngram_embedding)
            yield SimpleNamespace(stock=stock, ours=ours)
        finally:
            restore_ple_storage(ng, stock_classes)  # the other checks of this session see the release


def _runner_inputs(lens, max_reqs, contexts, gen):
    """What `Qwen4ExpModelState.prepare_inputs` hands the model: int32 query_start_loc padded with
    zero-length requests up to max_reqs, int32 ngram_context with one row per request slot."""
    n = sum(lens)
    ids = torch.randint(0, VOCAB, (n,), generator=gen, dtype=torch.int32)
    ids[n // 3] = EOS
    qsl = torch.full((max_reqs + 1,), n, dtype=torch.int32)
    qsl[0] = 0
    qsl[1:len(lens) + 1] = torch.tensor(lens).cumsum(0).to(torch.int32)
    ctx = torch.full((max_reqs, 2), EOS, dtype=torch.int32)
    for i, c in enumerate(contexts):
        ctx[i] = torch.tensor(c, dtype=torch.int32)
    return ids, qsl, ctx


CASES = {
    "profile-run": ([64], [[EOS, EOS]]),
    "prefill-chunks": ([37, 5, 20], [[EOS, EOS], [3, 4], [EOS, 9]]),
    "decode": ([1] * 6, [[1, 2], [EOS, 5], [7, EOS], [8, 9], [10, 11], [EOS, EOS]]),
    "mtp-verify": ([3, 3, 3], [[1, 2], [3, 4], [5, EOS]]),  # 1 + 2 draft positions per request
    # >= the Stager's dedup_min (1025) rows, every id distinct: deduplicated rows come back sorted and
    # still need the inverse (run38: 16-33-token prefills diverged from stock on the H200)
    "prefill-distinct": ([65], [[EOS, EOS]]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_patched_layer_forward_matches_stock(layers, base, case, request):
    if layers is None:
        assert not _storage_base(base)
        return
    checkpoint = request.getfixturevalue("checkpoint")
    lens, contexts = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    ids, qsl, ctx = _runner_inputs(lens, max_reqs=16, contexts=contexts, gen=gen)
    hs = torch.zeros(sum(lens), 64, dtype=torch.bfloat16)
    want = layers.stock.ngram_embedding.dequantize(layers.stock(hs, ids, qsl, ctx), torch.bfloat16)
    got = layers.ours.ngram_embedding.dequantize(layers.ours(hs, ids, qsl, ctx), torch.bfloat16)
    assert got.shape == want.shape == (sum(lens), 16 * HEAD_DIM)
    # both against an independent reference: the checkpoint's rows for the ids the stock layer
    # computes, dequantised (stock == ours alone would pass if both went wrong the same way)
    row_ids = layers.stock.compute_ngram_ids(ids, qsl, ctx)
    table = torch.cat([checkpoint.tensors[f"ngram_embedding.shard_{k}.weight"] for k in range(PARTS)])
    scale = checkpoint.tensors["ngram_embedding.weight_scale"].to(torch.bfloat16)
    ref = (table[row_ids.long()].to(torch.bfloat16) * scale).flatten(-2)
    assert torch.equal(want.view(torch.int16), ref.view(torch.int16))
    if case == "prefill-distinct":
        flat = row_ids.reshape(-1)
        assert flat.numel() >= 256 and flat.unique().numel() == flat.numel(), "case lost its point"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bitwise, fp8 NaNs included
    from flash_vllm.patches.p01_ple_mmap.debug import check_ids

    rep = check_ids(layers.ours, ids, qsl, ctx, checkpoint.rows, calls=0)
    assert rep["late_oob"] == rep["early_oob"] == 0 and rep["late_equal_ref"] and rep["early_equal_late"], rep
