"""The QSA indexer's logits workspace, the memory vLLM's profile run never sees (plan/workspace.py):
this release's own top-k selection run on CPU with only its Triton kernels and CUDA ops stubbed,
and the largest float32 logits block it allocates held to `flash plan`'s figure.

0.30 on: the release's `qsa_select_paged_prefill` and `_prefill_logits` run as written (the kernel
launch is a no-op), so the sizes are the tensors they allocate. 0.29: `qsa_select_paged_tokens`
runs as written (its chunking); `qsa_mqa_paged` demands CUDA before it allocates, so the stub
records the [rows, page table × page] block its source allocates instead.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from flash_cli.plan import workspace

RATIO = 4


class _Launch:
    """A Triton kernel whose `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def _inputs(ctx: int, block: int, rows: int):
    pages = -(-ctx // block)
    page = block // RATIO
    q = torch.zeros((rows, 2, 16), dtype=torch.bfloat16)
    k_cache = torch.zeros((pages, page, 1, 16), dtype=torch.bfloat16)
    page_table = torch.arange(pages, dtype=torch.int32).reshape(1, pages)
    return q, k_cache, page_table


def _largest_030(monkeypatch, base: str, ctx: int, block: int, rows: int, topk: int) -> int:
    from vllm.models.qwen4_exp.nvidia.ops import qsa_indexer as ops

    seen: list[int] = []
    real = ops._prefill_logits

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out.numel() * 4)
        bound = inspect.signature(real).bind(*args, **kwargs)
        if "logits_workspace" in bound.arguments:  # 0.31 on: the caller's whole workspace
            seen.append(bound.arguments["logits_workspace"].numel() * 4)
        return out

    monkeypatch.setattr(ops, "_qsa_mqa_paged_prefill_kernel", _Launch())
    monkeypatch.setattr(ops, "_prefill_logits", recorded)
    monkeypatch.setattr(ops, "_topk", lambda *a, **k: None)
    q, k_cache, page_table = _inputs(ctx, block, rows)
    ops.qsa_select_paged_prefill(
        q, k_cache, page_table, torch.tensor([0, rows], dtype=torch.int32),
        torch.full((rows,), ctx // RATIO, dtype=torch.int32), topk, RATIO, rows,
        torch.empty((rows, topk // RATIO), dtype=torch.int32), ctx)
    return max(seen)


def _largest_029(monkeypatch, ctx: int, block: int, rows: int, topk: int) -> int:
    from vllm.models.qwen4_exp.nvidia.ops import qsa as ops

    seen: list[int] = []

    def scored(q, k_cache, page_table, *rest, **kw):
        columns = page_table.shape[1] * k_cache.shape[1]  # qsa_mqa_paged's `capacity` (num_columns unset)
        seen.append(q.shape[0] * columns * 4)
        return torch.empty((q.shape[0], columns), dtype=torch.float32), torch.empty(q.shape[0], dtype=torch.int32)

    fake_c = types.SimpleNamespace(persistent_topk=lambda *a: None, cooperative_topk=lambda *a: None)

    class _Torch:  # the module's `torch`, with the CUDA-only ops it calls replaced
        ops = types.SimpleNamespace(_C=fake_c)

        def __getattr__(self, name):
            return getattr(torch, name)

    monkeypatch.setattr(ops, "qsa_mqa_paged", scored)
    monkeypatch.setattr(ops, "expand_qsa_block_indices_cuda", lambda *a, **k: None)
    monkeypatch.setattr(ops, "torch", _Torch())
    q, k_cache, page_table = _inputs(ctx, block, rows)
    ops.qsa_select_paged_tokens(q, k_cache, page_table, torch.zeros(rows, dtype=torch.int32),
                                torch.arange(rows, dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
                                topk, RATIO)
    return max(seen)


# (ctx, block, rows in the step): the recipe's CTX and BATCHED_TOKENS, a short context, a step of few rows
SHAPES = ((500_000, 1_600, 8_192), (8_192, 1_600, 4_096), (500_000, 1_600, 256), (2_048, 1_600, 2_048))


@pytest.mark.parametrize("ctx,block,rows", SHAPES)
def test_the_plan_names_the_largest_logits_block_this_release_allocates(monkeypatch, base, ctx, block, rows):
    topk = 2_048
    if base == "v0.29":
        got = _largest_029(monkeypatch, ctx, block, rows, topk)
    else:
        got = _largest_030(monkeypatch, base, ctx, block, rows, topk)
    planned = workspace.qsa_logits_bytes(base, ctx, block, RATIO, rows)
    assert got == planned, (base, ctx, block, rows, got, planned)


def test_a_long_prompt_meets_the_cap(base):
    """What the plan reports as outside the budget at the recipe's shape: the cap itself (0.29: 128
    MiB, 0.30 on: VLLM_SPARSE_INDEXER_MAX_LOGITS_MB, whose default is read from this release)."""
    from vllm import envs

    got = workspace.qsa_logits_bytes(base, 500_000, 1_600, RATIO, 8_192)
    if base == "v0.29":
        assert 127 * 2**20 < got <= 128 * 2**20
    else:
        assert envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB == workspace.MAX_LOGITS_MB
        assert workspace.MAX_LOGITS_MB * 2**20 - 2**20 < got <= workspace.MAX_LOGITS_MB * 2**20
