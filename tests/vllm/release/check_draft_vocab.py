"""Patch 10 with the real `Qwen4ExpMTP.compute_logits` and vLLM's LogitsProcessor on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

V, H = 512, 64


def _mtp(seed=0):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP

    g = torch.Generator().manual_seed(seed)
    model = object.__new__(Qwen4ExpMTP)
    torch.nn.Module.__init__(model)
    # the shared LM head as the logits processor uses it: weight, tp_size, quant_method.apply
    model.lm_head = SimpleNamespace(weight=torch.randn(V, H, generator=g), tp_size=1,
                                    quant_method=UnquantizedEmbeddingMethod())
    model.logits_processor = LogitsProcessor(V)
    return model


def test_reduced_logits_keep_argmax_in_set_and_minus_inf_elsewhere(registered, draft_ids):
    from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP

    ids = torch.as_tensor(draft_ids[0])
    fn = Qwen4ExpMTP.compute_logits
    assert fn.__flash_patch__ == 10
    model = _mtp()
    hidden = torch.randn(200, H, generator=torch.Generator().manual_seed(1))
    full = fn.__flash_original__(model, hidden)
    reduced = fn(model, hidden)
    assert reduced.shape == full.shape == (200, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(reduced[:, outside]).all()
    torch.testing.assert_close(reduced[:, ids], full[:, ids])
    in_set = torch.isin(full.argmax(-1), ids)
    assert in_set.any() and (~in_set).any()  # both cases occur in this sample
    assert torch.equal(reduced.argmax(-1)[in_set], full.argmax(-1)[in_set])
    assert torch.isin(reduced.argmax(-1), ids).all()
    # the private slice is built once and reused
    state = model.__dict__["_flash_draft_vocab"]
    fn(model, hidden)
    assert model.__dict__["_flash_draft_vocab"] is state and state.weight.shape == (len(ids), H)


def test_probabilistic_drafting_sees_a_proper_distribution(registered, draft_ids):
    """Softmax of the reduced logits: zero mass outside the set, the full head's renormalized inside."""
    from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP

    ids = torch.as_tensor(draft_ids[0])
    model = _mtp(2)
    hidden = torch.randn(16, H)
    q = torch.softmax(Qwen4ExpMTP.compute_logits(model, hidden), -1)
    p = torch.softmax(Qwen4ExpMTP.compute_logits.__flash_original__(model, hidden), -1)
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(16))
    mask = torch.zeros(V, dtype=torch.bool)
    mask[ids] = True
    assert (q[:, ~mask] == 0).all()
    torch.testing.assert_close(q[:, mask], p[:, mask] / p[:, mask].sum(-1, keepdim=True))


def test_sharded_or_quantized_head_passes_through(registered, draft_ids):
    from flash_vllm.patches.p10_mtp_draft_vocab import _PASS, build_reduced

    model = _mtp()
    model.lm_head.tp_size = 2  # vocab-parallel head: the slice would be per rank
    assert build_reduced(model, draft_ids[0]) is _PASS
    model = _mtp()
    model.lm_head.weight = model.lm_head.weight.to(torch.int8)  # a quantized draft head
    assert build_reduced(model, draft_ids[0]) is _PASS
    model = _mtp()
    assert build_reduced(model, draft_ids[0]) is not _PASS


def test_bad_id_files_are_refused(tmp_path):
    from flash_vllm.patches.p10_mtp_draft_vocab import DraftVocabError, load_ids, resolve_path

    bad = tmp_path / "dup.npy"
    np.save(bad, np.array([1, 2, 2]))
    with pytest.raises(DraftVocabError, match="duplicate"):
        load_ids(bad)
    neg = tmp_path / "neg.npy"
    np.save(neg, np.array([-1, 2]))
    with pytest.raises(DraftVocabError, match=r"\[0,"):
        load_ids(neg)
    with pytest.raises(DraftVocabError, match="absolute path"):
        resolve_path("ids.npy")
    assert resolve_path("0") is None and resolve_path("default").name == "draft_vocab_65536.npy"
