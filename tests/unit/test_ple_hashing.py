"""n-gram hashing: numpy ids bit-identical to transformers' qwen4_exp (real config and a tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # test extra: CPU torch 2.13.0 + transformers 5.24.0
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp import modeling_qwen4_exp as M

from flash_vllm.ple.hashing import PLELayout, ngram_ids, ngram_ids_batch, primes_from

EOS = 248044


def _real_cfg():
    return Qwen4ExpTextConfig(
        hidden_size=2560, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        ple_layer_ids=[2], ple_embed_dim=2560, vocab_size=248320, eos_token_id=EOS, split_ngram_parts=128)


class _IdsOnly(torch.nn.Module):
    """Stands in for nn.Embedding inside transformers' module so its forward returns the row ids
    (the real 320M-row embedding would need 200 GB); everything else is transformers' code."""

    def __init__(self, num, dim):
        super().__init__()
        self.num = num
        self.weight = torch.nn.Parameter(torch.empty(0))

    def forward(self, ids):
        return ids.unsqueeze(-1)


@pytest.fixture(scope="module")
def hf_real():
    orig = torch.nn.Embedding
    torch.nn.Embedding = _IdsOnly
    try:
        return M.Qwen4ExpTextNGramEmbedding(_real_cfg(), 2560, 1, 0)
    finally:
        torch.nn.Embedding = orig


def test_real_layout_matches_transformers_and_reference(hf_real):
    lay = PLELayout.from_config(_real_cfg())
    assert lay.multipliers == (23703573157769, 20109073645365, 8052911324071)
    assert lay.head_sizes[0] == 20000003 and lay.head_sizes[-1] == 20000171
    assert (lay.num_rows, lay.rows_per_shard, lay.num_shards, lay.head_dim) == (320001536, 2500012, 128, 160)
    assert hf_real.ngram_embedding.num == lay.num_rows
    lay.check_buffers(hf_real.layer_multipliers, hf_real.ngram_heads_offsets, hf_real.ngram_heads_vocab_sizes)
    with pytest.raises(ValueError, match="layer_multipliers"):
        lay.check_buffers([1, 2, 3], hf_real.ngram_heads_offsets, hf_real.ngram_heads_vocab_sizes)


def test_ids_match_transformers_with_eos(hf_real):
    lay = PLELayout.from_config(_real_cfg())
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 248320, size=(6, 64))
    tok[rng.random(tok.shape) < 0.12] = EOS
    tok[0, :3] = EOS  # EOS runs at the start
    tok[1, -1] = EOS
    want = hf_real(torch.from_numpy(tok), None).numpy()
    for b in range(tok.shape[0]):
        assert np.array_equal(ngram_ids(tok[b], lay), want[b])
    # Same tokens as one flat vLLM batch with query_start_loc.
    qsl = np.arange(0, tok.size + 1, tok.shape[1])
    assert np.array_equal(ngram_ids_batch(tok.reshape(-1), qsl, lay), want.reshape(-1, 16))


def test_context_continues_the_sequence():
    lay = PLELayout.from_config(_real_cfg())
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 248320, 40)
    seq[[5, 17, 18]] = EOS
    full = ngram_ids(seq, lay)
    for cut in (1, 2, 6, 18, 19, 39):
        assert np.array_equal(ngram_ids(seq[cut:], lay, context=seq[cut - 2 : cut] if cut >= 2 else [EOS, seq[0]]),
                              full[cut:])
    # Batched: three requests at different points, each with its own context.
    parts = [(0, 10), (18, 21), (30, 40)]
    toks = np.concatenate([seq[a:b] for a, b in parts])
    qsl = np.cumsum([0] + [b - a for a, b in parts])
    ctx = np.array([[EOS, EOS], seq[16:18], seq[28:30]])
    got = ngram_ids_batch(toks, qsl, lay, contexts=ctx)
    assert np.array_equal(got, np.concatenate([full[a:b] for a, b in parts]))
    with pytest.raises(ValueError, match="query_start_loc"):
        ngram_ids_batch(toks, [0, 5], lay)
    with pytest.raises(ValueError, match="context"):
        ngram_ids(seq, lay, context=[1])


def test_primes():
    assert primes_from(20_000_000, 3) == [20000003, 20000023, 20000033]
    assert primes_from(2, 5) == [2, 3, 5, 7, 11]


def test_tiny_model_generate_and_checkpoint(tmp_path):
    """A tiny random qwen4_exp: ids seen by its PLE embedding during prefill and cached decode
    equal ours, and its save_pretrained checkpoint (partial last shard) gathers to the same rows."""
    from transformers import Qwen4ExpForCausalLM

    from flash_vllm.ple.table import PLETable

    cfg = Qwen4ExpTextConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, layer_types=["linear_attention"] * 3 + ["full_attention"], ple_layer_ids=[2], vocab_size=300,
        eos_token_id=7, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=32, indexer_budget=8, indexer_compress_ratio=4, hc_count=2, hc_lowrank=8,
        ngram_vocab_size_base=1000, split_ngram_parts=7, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(cfg).eval()
    emb = model.model.layers[1].ple.ple_embedding
    w = emb.ngram_embedding.weight
    with torch.no_grad():  # row r holds r, so the embedding output spells the row ids
        w.copy_(torch.arange(w.shape[0], dtype=torch.float32)[:, None].expand_as(w))
    seen = []
    emb.register_forward_hook(lambda m, i, o: seen.append(o.detach().view(*o.shape[:2], 16, -1)[..., 0].round().long()))
    lay = PLELayout.from_config(cfg)
    prompt = torch.tensor([[5, 9, 7, 11, 12, 13, 7, 7, 100, 200]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=None)
    got = np.concatenate([s[0].numpy() for s in seen])
    assert len(seen) == 4  # prefill + 3 cached decode steps
    assert np.array_equal(got, ngram_ids(out[0].numpy()[: got.shape[0]], lay))
    model.save_pretrained(tmp_path)
    with PLETable.from_checkpoint(tmp_path, expected_rows=lay.num_rows) as t:
        assert t.dtype == "F32" and t.num_shards == 7 and t.num_rows == lay.num_rows
        assert t.shards[-1].rows < t.rows_per_shard  # transformers' torch.chunk leaves a partial last shard
        lay.check_buffers(**t.buffers)
        ids = ngram_ids(out[0].numpy(), lay)
        rows = t.gather(ids).view(np.float32).reshape(*ids.shape, -1)
        assert np.array_equal(rows[..., 0].astype(np.int64), ids)
        ref = emb.ngram_embedding.weight.detach().numpy()[ids]
        assert np.array_equal(rows, ref)
