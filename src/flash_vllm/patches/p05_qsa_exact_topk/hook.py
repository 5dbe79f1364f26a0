"""The QSA block top-k hook shared by patch 5 (exact) and patch 8 (deterministic).

Upstream selects the QSA blocks with `torch.ops._C.persistent_topk` (sm_12x) or
`cooperative_topk`. On 0.29 the dispatch sits inline in `ops/qsa.py::qsa_select_paged_tokens`;
from 0.30 on it is `ops/qsa_indexer.py::_topk`, called by the prefill and decode paths. The hook
replaces that dispatch; the mode is read from the environment when the hook is installed:

- `VLLM_QSA_EXACT_TOPK=1` (true/yes): exact `torch.topk` over the visible columns.
- `VLLM_QSA_EXACT_TOPK=fill`: the never-written columns (>= visible) are set to -inf, then the
  stock kernel runs (a diagnostic: does the stock kernel read past `visible`?).
- otherwise `VLLM_QSA_DET_TOPK=1`: the same exact path (patch 8 routes here instead of building
  an external kernel; see docs/PATCHES.md).
- `VLLM_QSA_DET_TOPK=radix`: patch 8 through `radix_block_topk` (patch 8's `radix.py`), a Triton
  radix select over the visible columns only (deterministic, ties to the lowest column). Measured on the H200
  (run4): faster than `det` up to 32k context, 11x stock at 128k, so it stays opt-in.
- `VLLM_QSA_DET_TOPK=repair` (the recipe's default): the stock kernel, then
  `repair_block_topk` (patch 8's `radix.py`) in place on its output: the same answer as `radix` for
  stock's cost plus two reads of the visible columns (a radix select only where the stock selection fails the
  kernel's certificate). Run44, graphs: 1.9-3.4x the stock kernel alone, against 10-40x for `1`.
- neither: the stock kernel, untouched (the hook passes through).

Everything here is capturable in a CUDA graph: no host sync, no data-dependent shapes.
"""

from __future__ import annotations

from typing import Mapping

from flash_common import releases

from ...registry import TRUE, Context, TargetMissing, expect_installed, expect_source, install

HOOK_NUMBER = 5  # the hook is installed once, under patch 5's mark, whichever patch asks first
M029 = "vllm.models.qwen4_exp.nvidia.ops.qsa"
M030 = "vllm.models.qwen4_exp.nvidia.ops.qsa_indexer"

# Where the stock dispatch lives, by the catalogue's `qsa_topk_site` (0.29: inline; 0.30+: `_topk`).
SITES = {"select-paged-tokens": (M029, "qsa_select_paged_tokens"), "indexer": (M030, "_topk")}
PORTED = frozenset(b for b in releases.ORDER if releases.cap(b, "qsa_topk_site") in SITES)


def inline(base: str) -> bool:
    """The selection is inline in `qsa_select_paged_tokens` (the whole function is replaced)."""
    return releases.cap(base, "qsa_topk_site") == "select-paged-tokens"


def target(base: str) -> tuple[str, str]:
    site = releases.cap(base, "qsa_topk_site")
    if site not in SITES:
        raise TargetMissing(f"no QSA top-k hook for {base} (catalogue: qsa_topk_site={site!r})")
    return SITES[site]


def mode(env: Mapping[str, str]) -> str | None:
    exact = env.get("VLLM_QSA_EXACT_TOPK", "").strip().lower()
    if exact == "fill":
        return "fill"
    if exact in TRUE:
        return "exact"
    det = env.get("VLLM_QSA_DET_TOPK", "").strip().lower()
    if det in TRUE:
        return "det"
    if det in ("radix", "repair"):
        return det
    return None


# The hook's body is picked by these, once, when it is installed: they change the traced code.
TRACED = ("VLLM_QSA_EXACT_TOPK", "VLLM_QSA_DET_TOPK")


def knobs(env: Mapping[str, str]) -> dict:
    """The compile key's state for patches 5 and 8 (one hook; the mode picks its body)."""
    return {"topk": mode(env) or "stock"}


def det_enabled(env: Mapping[str, str]) -> bool:
    """Patch 8's gate: VLLM_QSA_DET_TOPK=1 (the exact path), =radix or =repair (the Triton kernels)."""
    return mode({"VLLM_QSA_DET_TOPK": env.get("VLLM_QSA_DET_TOPK", "")}) is not None  # det, radix or repair


def _kernel(hook_mode: str | None):
    """The Triton kernel a mode runs (radix: instead of the stock op; repair: after it), else None."""
    if hook_mode not in ("radix", "repair"):
        return None
    from ..p08_qsa_det_topk import radix  # Triton: only when asked for

    return radix.radix_block_topk if hook_mode == "radix" else radix.repair_block_topk


def exact_block_topk(logits, visible_blocks, block_indices, block_topk: int, columns: int) -> None:
    """`block_indices[r] =` the top `block_topk` columns of `logits[r, :visible_blocks[r]]`, in
    ascending column order.

    Slots past `min(block_topk, visible)` get -1. `logits` is the indexer's scratch buffer whose
    columns >= visible were never written, so it is masked in place. The order is not cosmetic: the
    sparse attention adds the selected blocks in this order and its bf16 rounding follows it, so a
    score-ordered selection of the very same set changed greedy output on vLLM 0.29 (run41's
    probe_p5). Ascending is what the stock kernels write when every visible block is selected (their
    `visible <= k` shortcut) and what radix/repair write always: equal sets give equal bits.
    """
    import torch

    k = min(int(block_topk), int(columns))
    if k <= 0:
        block_indices.fill_(-1)
        return
    scores = logits[:, :columns]
    visible = visible_blocks.view(-1, 1).to(torch.int64)
    cols = torch.arange(columns, device=logits.device).view(1, -1)
    scores.masked_fill_(cols >= visible, float("-inf"))
    _, idx = torch.topk(scores, k, dim=1, largest=True, sorted=False)
    last = torch.full_like(idx, columns)  # sorts after every real column, then becomes -1
    idx = torch.sort(torch.where(idx < visible, idx, last), dim=1).values
    idx = torch.where(idx < columns, idx, torch.full_like(idx, -1))
    block_indices[:, :k].copy_(idx.to(block_indices.dtype))
    if k < block_indices.shape[1]:
        block_indices[:, k:].fill_(-1)


def fill_invisible(logits, visible_blocks, columns: int) -> None:
    import torch

    cols = torch.arange(columns, device=logits.device).view(1, -1)
    logits[:, :columns].masked_fill_(cols >= visible_blocks.view(-1, 1).to(torch.int64), float("-inf"))


def check(ctx: Context) -> None:
    module, name = target(ctx.base.name)
    if inline(ctx.base.name):
        expect_source(module, name, "torch.ops._C.persistent_topk", "qsa_mqa_paged(",
                      "expand_qsa_block_indices_cuda(",
                      "topk_op(logits, visible_blocks, blocks, topk_workspace, block_topk, columns)")
    else:
        expect_source(module, name, "torch.ops._C.persistent_topk", "block_topk = token_topk // compress_ratio",
                      "logits.shape[1]")


def _make_030(orig, hook_mode):
    kernel = _kernel(hook_mode)

    def _topk(logits, visible_blocks, token_topk, compress_ratio, block_indices, topk_workspace):
        if hook_mode == "radix":
            kernel(logits, visible_blocks, block_indices, token_topk // compress_ratio, logits.shape[1])
            return None
        if hook_mode == "repair":  # same buffers and length bound as the stock op just used
            res = orig(logits, visible_blocks, token_topk, compress_ratio, block_indices, topk_workspace)
            kernel(logits, visible_blocks, block_indices, token_topk // compress_ratio, logits.shape[1])
            return res
        if hook_mode in ("exact", "det"):
            exact_block_topk(logits, visible_blocks, block_indices, token_topk // compress_ratio,
                             logits.shape[1])
            return None
        if hook_mode == "fill":
            fill_invisible(logits, visible_blocks, logits.shape[1])
        return orig(logits, visible_blocks, token_topk, compress_ratio, block_indices, topk_workspace)

    _topk.__doc__ = orig.__doc__
    _topk.__name__ = orig.__name__
    _topk.flash_mode = hook_mode
    return _topk


def _make_029(orig, hook_mode):
    import torch

    m = __import__(M029, fromlist=["_"])
    kernel = _kernel(hook_mode)

    # Copied from vLLM 0.29.0 ops/qsa.py::qsa_select_paged_tokens (the top-k dispatch is inline
    # there, so it cannot be wrapped); only the marked lines differ. `check()` pins the anchors.
    def qsa_select_paged_tokens(q, k_cache, page_table, token_to_req, query_positions,
                                sequence_lengths, token_topk, compress_ratio, out=None):
        if hook_mode is None:
            return orig(q, k_cache, page_table, token_to_req, query_positions, sequence_lengths,
                        token_topk, compress_ratio, out)
        rows = q.shape[0]
        output_width = token_topk + compress_ratio - 1
        if out is None:
            out = torch.empty((rows, output_width), dtype=torch.int32, device=q.device)
        if out.shape != (rows, output_width):
            raise ValueError("QSA selection output has an invalid shape")
        if not rows:
            return out
        columns = page_table.shape[1] * k_cache.shape[1]
        block_topk = token_topk // compress_ratio
        rows_per_chunk = max(1, m._LOGITS_WORKSPACE_BYTES // max(columns * 4, 1))
        chunk_rows = min(rows, rows_per_chunk)
        blocks_buffer = torch.empty((chunk_rows, block_topk), dtype=torch.int32, device=q.device)
        topk_workspace = torch.empty((m._TOPK_WORKSPACE_BYTES,), dtype=torch.uint8, device=q.device)
        for row_start in range(0, rows, rows_per_chunk):
            row_end = min(row_start + rows_per_chunk, rows)
            row_slice = slice(row_start, row_end)
            logits, visible_blocks = m.qsa_mqa_paged(
                q[row_slice], k_cache, page_table, token_to_req[row_slice],
                query_positions[row_slice], sequence_lengths, compress_ratio)
            blocks = blocks_buffer[: row_end - row_start]
            # --- flash patch 5/8 begin: exact, masked or repaired top-k instead of the stock dispatch
            if hook_mode == "radix":
                kernel(logits, visible_blocks, blocks, block_topk, columns)
            elif hook_mode in ("exact", "det"):
                exact_block_topk(logits, visible_blocks, blocks, block_topk, columns)
            else:
                if hook_mode == "fill":  # not for repair: a full-width write is the cost it avoids
                    fill_invisible(logits, visible_blocks, columns)
                use_cooperative_topk = (
                    blocks.shape[0] <= 32 and logits.stride(0) % 4 == 0
                    and m.current_platform.has_device_capability(90)
                    and not m.current_platform.is_device_capability_family(120))
                topk_op = (torch.ops._C.cooperative_topk if use_cooperative_topk
                           else torch.ops._C.persistent_topk)
                topk_op(logits, visible_blocks, blocks, topk_workspace, block_topk, columns)
                if hook_mode == "repair":
                    kernel(logits, visible_blocks, blocks, block_topk, columns)
            # --- flash patch 5/8 end
            m.expand_qsa_block_indices_cuda(
                blocks, query_positions[row_slice], sequence_lengths, token_to_req[row_slice],
                compress_ratio, token_topk, out[row_slice])
        return out

    qsa_select_paged_tokens.__doc__ = orig.__doc__
    qsa_select_paged_tokens.flash_mode = hook_mode
    return qsa_select_paged_tokens


def make_hook(orig, hook_mode: str | None, base: str):
    """The replacement `install_hook` puts in place of `orig` on `base` (0.29: the whole
    `qsa_select_paged_tokens`; 0.30+: `_topk`). tools/bench_step_kernels.py times the 0.30+ one."""
    return (_make_029 if inline(base) else _make_030)(orig, hook_mode)


def install_hook(ctx: Context) -> None:
    module, name = target(ctx.base.name)
    hook_mode = mode(ctx.env)
    installed = install(HOOK_NUMBER, module, name, lambda orig: make_hook(orig, hook_mode, ctx.base.name))
    if installed.flash_mode != hook_mode:
        raise TargetMissing(f"QSA top-k hook already installed in mode {installed.flash_mode!r}, "
                            f"asked for {hook_mode!r}")


def verify(ctx: Context) -> None:
    module, name = target(ctx.base.name)
    expect_installed(HOOK_NUMBER, module, name)
