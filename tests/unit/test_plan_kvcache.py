"""The KV layout model against the structural facts vLLM prints and the field reported."""

from __future__ import annotations

import pytest

from flash_cli.geometry import REAL
from flash_cli.plan.kvcache import _approximate_gcd, cdiv, layout


def lay(**kw):
    args = dict(base="v0.29", kv_dtype="auto", mtp=2, prefix_cache=True, max_model_len=500_000)
    args.update(kw)
    return layout(REAL, **args)


def test_gdn_mamba_page_matches_the_field():
    # seed 004: "the mamba group dominates, at 3,207,168 B per page" (no MTP)
    assert lay(mtp=0).mamba_page_unpadded == 3_207_168


@pytest.mark.parametrize("mtp, block, ring", [(0, 1568, 4), (2, 1600, 8), (3, 1600, 8)])
def test_block_size_and_ring_capacity(mtp, block, ring):
    # seed 004: "Setting attention block size to 1568"; seed 003: Mamba block 1600 with MTP=2,
    # QSA raw-key ring "8 tokens here with MTP=2 (4 without)"
    out = lay(mtp=mtp)
    assert (out.block_size, out.ring_capacity) == (block, ring)
    assert out.block_size % out.ring_capacity == 0


def test_033_prefix_caching_aligns_to_flashinfer_checkpoints():
    out = lay(base="v0.33", mtp=0)
    assert out.block_size % 64 == 0 and out.block_size == 1600
    assert lay(base="v0.33", mtp=0, prefix_cache=False).block_size == 1568


def test_groups_pack_qsa_layers_and_split_gdn():
    out = lay(mtp=2)
    described = sorted(g.describe() for g in out.groups)
    # 13 QSA layers (12 + the drafter's, seed 004: "THIRTEEN times") share one group with their
    # compressed keys; 36 GDN layers split in 3 groups of 12; the PLE conv state is its own group
    assert described == sorted(["13×qsa_index_keys + 13×qsa_kv", "13×qsa_ring", "12×gdn_state", "12×gdn_state",
                                "12×gdn_state", "1×ple_conv_state"])
    assert out.bytes_per_block == 13 * (1600 * 2048 + 1600 * 64)
    # per request at 500k: cdiv(500000, 1600) attention blocks + 3 GDN groups × (2 + 2) + PLE (2 + 2) + 1 ring
    assert out.blocks_per_request == cdiv(500_000, 1600) + 3 * 4 + 4 + 1


def test_mtp_adds_the_drafter_qsa_layer():
    assert lay(mtp=0).bytes_per_token() == 12 * (2048 + 64)
    assert lay(mtp=2).bytes_per_token() == 13 * (2048 + 64)


def test_fp8_halves_the_main_kv_only():
    bf16, fp8 = lay(base="v0.33"), lay(base="v0.33", kv_dtype="fp8_e4m3")
    assert fp8.attn_page_per_token * 2 == bf16.attn_page_per_token
    assert fp8.bytes_per_token() == 13 * (1024 + 64)  # the indexer keys stay bf16
    mem = 20 * 1024**3
    assert 1.8 < fp8.tokens(mem) / bf16.tokens(mem) < 2.0


def test_tokens_is_concurrency_times_max_model_len():
    out = lay()
    mem = 19 * 1024**3
    blocks = mem // out.bytes_per_block
    assert out.tokens(mem) == int(blocks / out.blocks_per_request * 500_000)
    assert out.tokens(out.bytes_per_block - 1) == 0


def test_more_memory_more_tokens_longer_ctx_less_concurrency():
    out = lay()
    mems = [10, 15, 20, 30]
    toks = [out.tokens(m * 1024**3) for m in mems]
    assert toks == sorted(toks) and len(set(toks)) == len(toks)
    assert lay(max_model_len=1_000_000).concurrency(20 * 1024**3) < lay(max_model_len=250_000).concurrency(20 * 1024**3)


def test_without_prefix_caching_mamba_holds_fewer_blocks():
    assert lay(prefix_cache=False).blocks_per_request == cdiv(500_000, 1600) + 3 * 3 + 3 + 1


def test_approximate_gcd_matches_vllm_rule():
    assert _approximate_gcd([36, 1, 12, 12], 12) == 12
    assert _approximate_gcd([36, 1, 13, 13], 13) == 13
    assert _approximate_gcd([8, 8], 1) == 8


def test_per_cache_breakdown():
    rows = {r["cache"]: r for r in lay(base="v0.33").per_cache()}
    assert rows["qsa_kv"]["bytes_per_token"] == 13 * 2048 and rows["qsa_index_keys"]["bytes_per_token"] == 13 * 64
    assert rows["gdn_state"]["layers"] == 36 and rows["gdn_state"]["blocks_per_request"] == 2 + 2 + 1  # 0.33 checkpoint
    assert rows["gdn_state"]["page_bytes"] == 1600 * 2048  # padded to one attention page
    assert rows["ple_conv_state"]["layers"] == 1 and rows["qsa_ring"]["blocks_per_request"] == 1
    assert lay(base="v0.29").per_cache()[0]["blocks_per_request"] == 2 + 2
