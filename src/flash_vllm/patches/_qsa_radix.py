"""A deterministic QSA block top-k that reads only the visible columns (patch 8's `radix` mode).

Patch 8's default path (`_qsa_topk.exact_block_topk`) masks the whole scores row and runs
`torch.topk` over it: its cost follows the row width, which is max_model_len / compress_ratio
(125,056 columns at flash's CTX=500000), not the context. On the H200 that is 5.5-34.6x the stock
kernels (docs/benchmarks/decode-h200/KERNELS.md). This kernel is the candidate replacement:

- one program per row, loops over `min(visible, columns)` columns only;
- a 4-pass radix select (8-bit digits of an order-preserving integer key of the fp32 score)
  finds the k-th largest key exactly; histograms count, they never race (`tl.histogram`);
- a last pass writes the selected columns in ascending column order: every score above the k-th
  key, then as many of the scores equal to it as needed, lowest columns first. The result is a
  function of the scores alone: the same set and order on every call, batch and graph replay;
- slots past `min(k, visible)` get -1, as the stock kernels and the exact path leave them.

Ties are broken by column and compared by bit pattern (-0.0 ranks below +0.0; the stock kernels
and torch.topk make no promise on ties). Order differs from `torch.topk(sorted=True)` (score
order); `expand_qsa_block_indices_cuda` and the sparse attention treat the selection as a set.

No host sync and fixed launch shapes: capturable in a CUDA graph. Imported only when
VLLM_QSA_DET_TOPK=radix (it needs Triton, which the vLLM image has); the unit tier runs it through
Triton's interpreter (TRITON_INTERPRET=1) on CPU. Not yet measured on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024  # columns per loop step


@triton.jit
def _key(x):
    # fp32 -> a non-negative int64 below 2**32 that orders like the float
    b = x.to(tl.int32, bitcast=True)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)  # signed int32 ordered like the float
    return s.to(tl.int64) + 2147483648


@triton.jit
def _radix_block_topk(logits_ptr, stride_row, visible_ptr, out_ptr, stride_out, columns, k, width,
                      BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = logits_ptr + r.to(tl.int64) * stride_row
    orow = out_ptr + r.to(tl.int64) * stride_out
    v = tl.maximum(tl.minimum(tl.load(visible_ptr + r).to(tl.int32), columns), 0)
    kk = tl.minimum(v, k)
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.int64)  # the k-th key's digits found so far
    pmask = tl.full([], 0, tl.int64)
    remaining = kk  # how many of the keys matching `prefix` still belong to the top k
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # a constexpr (p is); annotating it fails on the real compiler (run38)
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, v, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < v
            key = _key(tl.load(row + offs, mask=m, other=0.0))
            match = m & ((key & pmask) == prefix)
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
        ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys whose digit >= bin
        d = tl.max(tl.where(ge >= remaining, bins, -1), axis=0)  # the k-th key's digit
        above = tl.sum(tl.where(bins == d, ge - hist, 0), axis=0)  # keys with a larger digit
        remaining = remaining - above
        prefix = prefix | (d.to(tl.int64) << shift)
        pmask = pmask | (tl.full([], 0xFF, tl.int64) << shift)
    # `prefix` is the k-th largest key; `remaining` of the keys equal to it are selected
    written = 0
    ties = 0
    for start in range(0, v, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < v
        key = _key(tl.load(row + offs, mask=m, other=0.0))
        eq = (m & (key == prefix)).to(tl.int32)
        take = (m & (key > prefix)) | ((eq == 1) & (tl.cumsum(eq, axis=0) + ties <= remaining))
        take32 = take.to(tl.int32)
        pos = tl.cumsum(take32, axis=0) - 1 + written
        tl.store(orow + pos, offs.to(tl.int32), mask=take & (kk > 0))
        written += tl.sum(take32, axis=0)
        ties += tl.sum(eq, axis=0)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(orow + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= written) & (offs < width))


def radix_block_topk(logits, visible_blocks, block_indices, block_topk: int, columns: int) -> None:
    """`block_indices[r] =` the top `block_topk` columns of `logits[r, :visible_blocks[r]]`, in
    column order, ties to the lowest column; -1 past min(block_topk, visible). `logits` is fp32 with
    unit column stride and `block_indices` int32 (what the indexer hands the stock kernels)."""
    rows = logits.shape[0]
    if rows == 0:
        return
    if logits.dtype.itemsize != 4 or not logits.dtype.is_floating_point or logits.stride(1) != 1:
        raise ValueError(f"radix top-k needs fp32 scores with unit column stride, got {logits.dtype} "
                         f"stride {tuple(logits.stride())}")
    if block_indices.dtype.itemsize != 4 or block_indices.dtype.is_floating_point:
        raise ValueError(f"radix top-k writes int32 block indices, got {block_indices.dtype}")
    _radix_block_topk[(rows,)](logits, logits.stride(0), visible_blocks, block_indices, block_indices.stride(0),
                               int(columns), max(int(block_topk), 0), block_indices.shape[1], BLOCK=BLOCK)
