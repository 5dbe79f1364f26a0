"""Patches 5 and 8: the installed QSA top-k hook on CPU tensors.

Exact top-k must equal `torch.topk` over the visible columns, never select an invisible column,
pad with -1, and give identical results across calls.
"""

from __future__ import annotations

import pytest
import torch

from flash_vllm.patches.p05_qsa_exact_topk import hook

VISIBLE = [1000, 600, 128, 8, 3, 0]
TOKEN_TOPK, RATIO = 32, 4          # block_topk = 8
BLOCK_TOPK = TOKEN_TOPK // RATIO


def _logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(VISIBLE), 1000, generator=g)
    # the never-written columns of the scratch buffer: garbage that would win a naive top-k
    for r, v in enumerate(VISIBLE):
        logits[r, v:] = 1e6
    return logits


def _check_rows(blocks: torch.Tensor, logits: torch.Tensor):
    for r, v in enumerate(VISIBLE):
        k = min(BLOCK_TOPK, v)
        row = blocks[r].tolist()
        chosen = [c for c in row if c >= 0]
        assert len(chosen) == k and row[k:] == [-1] * (BLOCK_TOPK - k)
        assert all(c < v for c in chosen), "selected an invisible column"
        # ascending column order, as stock's kernels write it when every visible block is chosen (and
        # radix always): the attention's rounding follows the order (score order: run41's probe_p5)
        assert chosen == sorted(chosen), f"row {r}: not in ascending column order: {chosen}"
        if v <= BLOCK_TOPK:
            assert chosen == list(range(v))
        if k:
            ref = torch.topk(logits[r, :v], k).indices.tolist()
            assert sorted(chosen) == sorted(ref)


def _run_hook(base, logits):
    visible = torch.tensor(VISIBLE, dtype=torch.int32)
    blocks = torch.full((len(VISIBLE), BLOCK_TOPK), 12345, dtype=torch.int32)
    if hook.inline(base):  # the catalogue's qsa_topk_site: the whole selection is replaced
        import vllm.models.qwen4_exp.nvidia.ops.qsa as m

        fn = m.qsa_select_paged_tokens
        assert fn.__flash_patch__ == 5 and fn.flash_mode == "exact"
        captured = []
        # CPU stand-ins for the two CUDA kernels around the selection (scores in, expansion out)
        orig_mqa, orig_expand = m.qsa_mqa_paged, m.expand_qsa_block_indices_cuda
        m.qsa_mqa_paged = lambda *a: (logits.clone(), visible)
        m.expand_qsa_block_indices_cuda = lambda b, *a: captured.append(b.clone())
        try:
            rows = len(VISIBLE)
            k_cache = torch.zeros(10, 100, 1, 1)
            page_table = torch.zeros(rows, 10, dtype=torch.int32)  # 10 pages x 100 = 1000 columns
            z = torch.zeros(rows, dtype=torch.int32)
            fn(torch.zeros(rows, 1), k_cache, page_table, z, z, z, TOKEN_TOPK, RATIO)
        finally:
            m.qsa_mqa_paged, m.expand_qsa_block_indices_cuda = orig_mqa, orig_expand
        return torch.cat(captured)
    import vllm.models.qwen4_exp.nvidia.ops.qsa_indexer as qi

    assert qi._topk.__flash_patch__ == 5 and qi._topk.flash_mode == "exact"
    qi._topk(logits.clone(), visible, TOKEN_TOPK, RATIO, blocks, torch.empty(0, dtype=torch.uint8))
    return blocks


def test_exact_topk_matches_torch_topk_over_visible_columns(registered, base):
    logits = _logits()
    _check_rows(_run_hook(base, logits), logits)


def test_exact_topk_is_identical_across_calls(registered, base):
    logits = _logits(1)
    logits[0, :50] = 0.25  # ties
    first = _run_hook(base, logits)
    for _ in range(3):
        assert torch.equal(_run_hook(base, logits), first)


def test_det_mode_routes_to_the_exact_path(registered):
    from flash_vllm.patches.p05_qsa_exact_topk import hook as _qsa_topk

    assert _qsa_topk.mode({"VLLM_QSA_DET_TOPK": "1"}) == "det"
    assert _qsa_topk.mode({"VLLM_QSA_DET_TOPK": "1", "VLLM_QSA_EXACT_TOPK": "fill"}) == "fill"
    assert _qsa_topk.mode({"VLLM_QSA_EXACT_TOPK": "true"}) == "exact"
    assert _qsa_topk.mode({}) is None


def test_fill_masks_never_written_columns():
    from flash_vllm.patches.p05_qsa_exact_topk.hook import fill_invisible

    logits = _logits()
    fill_invisible(logits, torch.tensor(VISIBLE, dtype=torch.int32), 1000)
    for r, v in enumerate(VISIBLE):
        assert torch.isinf(logits[r, v:]).all() and not torch.isinf(logits[r, :v]).any()


def test_hook_replaced_the_stock_dispatch_source(registered, base):
    """The stock dispatch the hook replaces is still what the release calls."""
    import inspect

    if hook.inline(base):  # the catalogue's qsa_topk_site: the whole selection is replaced
        import vllm.models.qwen4_exp.nvidia.ops.qsa as m

        src = inspect.getsource(m.qsa_select_paged_tokens.__flash_original__)
    else:
        import vllm.models.qwen4_exp.nvidia.ops.qsa_indexer as m

        src = inspect.getsource(m._topk.__flash_original__)
        callers = inspect.getsource(m)
        assert callers.count("_topk(") >= 3  # def + the prefill and decode call sites
    assert "persistent_topk" in src
