"""Deterministic QSA block top-k kernels that read only the visible columns (patch 8's `repair` and
`radix` modes).

Patch 8's `1` mode (`exact_block_topk` in patch 5's `hook.py`) masks the whole scores row and runs
`torch.topk` over it: its cost follows the row width, which is max_model_len / compress_ratio (125,056 columns
at flash's CTX=500000), not the context. On the H200 that is 10-40x the stock kernels in graphs
(run44; benchmarks/decode-h200/KERNELS.md). Two kernels here, each looping over
`min(visible, columns)` columns only:

- `radix_block_topk` (`radix`, one program per row): a 4-pass radix select (8-bit digits of an
  order-preserving integer key of the fp32 score) finds the k-th largest key exactly; histograms
  count, they never race (`tl.histogram`). Run4: 7.9 us at 8k context, 100 us at 128k (five reads
  of the row).
- `repair_block_topk` (`repair`, patch 8's default): runs after the stock kernel, in place on its
  output. t = the smallest selected key. It is the k-th largest key exactly when fewer than
  kk = min(k, visible) keys of the row are above t and at least kk reach it: a certificate read off
  the counts the write needs anyway. Certified, every key above t is taken and the ties at t go to
  the lowest columns. Not certified (the stock kernel dropped a candidate, vllm#51782), the kernel
  finds the k-th key by the same radix select as `radix`. So the output is the exact top-k whatever
  the stock kernel returned. Two launches over rows x slices of SLICE columns: every program counts
  the keys above and equal to t in its slice, then every program checks the row's certificate and
  writes its slice's share, starting where the counts say the slices before it end.
  `slice_columns=None` runs one program per row instead (the reference, the bench's
  `repair_serial`): the same output, element for element. Run44, before the certificate, in
  graphs: 1.9-3.4x the stock kernel alone at 8k-128k context (one program per row: 2.4-6.2x).

Both write what `_write_selection` writes (`_repair_write` is its pass cut into slices): the
selected columns in ascending column order, every key above the k-th one, then as many keys equal
to it as needed, lowest columns first; -1 past min(k, visible), as the stock kernels and the exact
path leave them. The result is a function of the scores alone: the same set and order on every
call, batch and graph replay.

Ties are broken by column and compared by bit pattern (-0.0 ranks below +0.0; the stock kernels
and torch.topk make no promise on ties). The exact path writes the same ascending order: the
sparse attention's bf16 rounding follows the selection's order (score order changed greedy output
on 0.29, run41), so only equal sets in equal order give equal bits.

No host sync and fixed launch shapes: capturable in a CUDA graph. Imported only when
VLLM_QSA_DET_TOPK=radix or =repair (it needs Triton, which the vLLM image has); the unit tier runs
it through Triton's interpreter (TRITON_INTERPRET=1) on CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024  # columns per loop step
SLICE = 2048  # columns per program in the repair's two launches (rows x slices programs)


@triton.jit
def _key(x):
    # fp32 -> a non-negative int64 below 2**32 that orders like the float
    b = x.to(tl.int32, bitcast=True)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)  # signed int32 ordered like the float
    return s.to(tl.int64) + 2147483648


@triton.jit
def _write_selection(row, orow, v, kk, t, remaining, width, BLOCK: tl.constexpr):
    # orow[:] = every column below v whose key is > t, then the lowest `remaining` columns whose key
    # is == t, in ascending column order, at most min(kk, width) of them (a bad t or remaining
    # cannot overflow the row); then -1 up to width
    cap = tl.minimum(kk, width)
    written = 0
    ties = 0
    for start in range(0, v, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < v
        key = _key(tl.load(row + offs, mask=m, other=0.0))
        eq = (m & (key == t)).to(tl.int32)
        take = (m & (key > t)) | ((eq == 1) & (tl.cumsum(eq, axis=0) + ties <= remaining))
        take32 = take.to(tl.int32)
        pos = tl.cumsum(take32, axis=0) - 1 + written
        tl.store(orow + pos, offs.to(tl.int32), mask=take & (pos < cap))
        written += tl.sum(take32, axis=0)
        ties += tl.sum(eq, axis=0)
    written = tl.minimum(written, cap)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(orow + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= written) & (offs < width))


@triton.jit
def _kth_key(row, v, kk, BLOCK: tl.constexpr):
    # (the kk-th largest key of row[:v], how many of the keys equal to it belong to the top kk): a
    # 4-pass radix select over 8-bit digits; histograms count, they never race (tl.histogram)
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
    return prefix, remaining


@triton.jit
def _radix_block_topk(logits_ptr, stride_row, visible_ptr, out_ptr, stride_out, columns, k, width,
                      BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = logits_ptr + r.to(tl.int64) * stride_row
    orow = out_ptr + r.to(tl.int64) * stride_out
    v = tl.maximum(tl.minimum(tl.load(visible_ptr + r).to(tl.int32), columns), 0)
    kk = tl.minimum(v, k)
    t, remaining = _kth_key(row, v, kk, BLOCK)
    _write_selection(row, orow, v, kk, t, remaining, width, BLOCK)


@triton.jit
def _count(row, lo, hi, t, BLOCK: tl.constexpr):
    # (keys above t, keys equal to t) among row[lo:hi]
    gt = tl.full([], 0, tl.int32)
    eq = tl.full([], 0, tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < hi
        key = _key(tl.load(row + offs, mask=m, other=0.0))
        gt += tl.sum((m & (key > t)).to(tl.int32), axis=0)
        eq += tl.sum((m & (key == t)).to(tl.int32), axis=0)
    return gt, eq


@triton.jit
def _certified(kk, gt, eq):
    # t is the kk-th largest key exactly when fewer than kk keys are above it and kk reach it
    return (kk == 0) | ((gt < kk) & (kk <= gt + eq))


@triton.jit
def _threshold(row, orow, v, k, width, SLOTS: tl.constexpr):
    # the smallest key among the stock selection's visible slots: the k-th largest key when the
    # selection is an exact top-k (every key above it is then in any exact top-k; only which keys
    # equal to it made it can vary between runs); 2**32, above every key, when no slot is visible
    slots = tl.arange(0, SLOTS)
    idx = tl.load(orow + slots, mask=slots < tl.minimum(k, width), other=-1)
    valid = (idx >= 0) & (idx < v)
    key = tl.where(valid, _key(tl.load(row + idx, mask=valid, other=0.0)), 4294967296)
    return tl.min(key, axis=0)


@triton.jit
def _repair_serial(logits_ptr, stride_row, visible_ptr, out_ptr, stride_out, columns, k, width,
                   SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row: the stock threshold, its certificate (one counting pass), the radix
    # select where it fails, then the write pass over every visible column
    r = tl.program_id(0)
    row = logits_ptr + r.to(tl.int64) * stride_row
    orow = out_ptr + r.to(tl.int64) * stride_out
    v = tl.maximum(tl.minimum(tl.load(visible_ptr + r).to(tl.int32), columns), 0)
    kk = tl.minimum(v, k)
    t = _threshold(row, orow, v, k, width, SLOTS)  # read whole before the write overwrites it
    gt, eq = _count(row, 0, v, t, BLOCK)
    if _certified(kk, gt, eq):
        remaining = kk - gt
    else:  # the stock selection was not an exact top-k (vllm#51782): find the k-th key here
        t, remaining = _kth_key(row, v, kk, BLOCK)
    _write_selection(row, orow, v, kk, t, remaining, width, BLOCK)


@triton.jit
def _repair_count(logits_ptr, stride_row, visible_ptr, out_ptr, stride_out, scratch_ptr, stride_scratch,
                  columns, k, width, SLOTS: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr):
    # program (r, s): the keys above t and equal to t in columns [s*SLICE, (s+1)*SLICE) of row r's
    # visible part -> scratch[r, 1 + 2s], scratch[r, 2 + 2s]; program (r, 0) also stores t in
    # scratch[r, 0]. Slices past the visible part are never read by _repair_write, so their
    # programs do nothing.
    r = tl.program_id(0)
    s = tl.program_id(1)
    row = logits_ptr + r.to(tl.int64) * stride_row
    orow = out_ptr + r.to(tl.int64) * stride_out
    srow = scratch_ptr + r.to(tl.int64) * stride_scratch
    v = tl.maximum(tl.minimum(tl.load(visible_ptr + r).to(tl.int32), columns), 0)
    lo = s * SLICE
    if (lo < v) | (s == 0):
        t = _threshold(row, orow, v, k, width, SLOTS)
        gt, eq = _count(row, lo, tl.minimum(lo + SLICE, v), t, BLOCK)
        tl.store(srow + 1 + 2 * s, gt.to(tl.int64))
        tl.store(srow + 2 + 2 * s, eq.to(tl.int64))
        if s == 0:
            tl.store(srow, t)


@triton.jit
def _repair_write(logits_ptr, stride_row, visible_ptr, out_ptr, stride_out, scratch_ptr, stride_scratch,
                  columns, k, width, MAX_S: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr):
    # program (r, s): the row's certificate from every slice's counts, then _write_selection's pass
    # over slice s alone, started where the slices before it left off (their takes and their t-keys);
    # program (r, 0) also writes the -1 tail. The same output as _repair_serial, element for element.
    r = tl.program_id(0)
    s = tl.program_id(1)
    row = logits_ptr + r.to(tl.int64) * stride_row
    orow = out_ptr + r.to(tl.int64) * stride_out
    srow = scratch_ptr + r.to(tl.int64) * stride_scratch
    v = tl.maximum(tl.minimum(tl.load(visible_ptr + r).to(tl.int32), columns), 0)
    lo = s * SLICE
    if (lo < v) | (s == 0):
        kk = tl.minimum(v, k)
        cap = tl.minimum(kk, width)
        t = tl.load(srow)
        js = tl.arange(0, MAX_S)
        used = js < (v + SLICE - 1) // SLICE
        gt = tl.load(srow + 1 + 2 * js, mask=used, other=0).to(tl.int32)
        eq = tl.load(srow + 2 + 2 * js, mask=used, other=0).to(tl.int32)
        if _certified(kk, tl.sum(gt, axis=0), tl.sum(eq, axis=0)):
            remaining = kk - tl.sum(gt, axis=0)
            gt_before = tl.sum(tl.where(js < s, gt, 0), axis=0)
            ties = tl.sum(tl.where(js < s, eq, 0), axis=0)
        else:  # not an exact top-k (vllm#51782): every program of the row finds the k-th key itself
            t, remaining = _kth_key(row, v, kk, BLOCK)
            gt_before, ties = _count(row, 0, lo, t, BLOCK)
        written = gt_before + tl.minimum(tl.maximum(remaining, 0), ties)  # ties go lowest columns first
        hi = tl.minimum(lo + SLICE, v)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < hi
            key = _key(tl.load(row + offs, mask=m, other=0.0))
            e = (m & (key == t)).to(tl.int32)
            take = (m & (key > t)) | ((e == 1) & (tl.cumsum(e, axis=0) + ties <= remaining))
            take32 = take.to(tl.int32)
            pos = tl.cumsum(take32, axis=0) - 1 + written
            tl.store(orow + pos, offs.to(tl.int32), mask=take & (pos < cap))
            written += tl.sum(take32, axis=0)
            ties += tl.sum(e, axis=0)
        if s == 0:  # an exact top-k fills min(kk, width) slots, certified or found
            for start in range(0, width, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                tl.store(orow + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= cap) & (offs < width))


def _refuse(what: str, logits, block_indices) -> None:
    if logits.dtype.itemsize != 4 or not logits.dtype.is_floating_point or logits.stride(1) != 1:
        raise ValueError(f"{what} top-k needs fp32 scores with unit column stride, got {logits.dtype} "
                         f"stride {tuple(logits.stride())}")
    if block_indices.dtype.itemsize != 4 or block_indices.dtype.is_floating_point:
        raise ValueError(f"{what} top-k writes int32 block indices, got {block_indices.dtype}")


def radix_block_topk(logits, visible_blocks, block_indices, block_topk: int, columns: int) -> None:
    """`block_indices[r] =` the top `block_topk` columns of `logits[r, :visible_blocks[r]]`, in
    column order, ties to the lowest column; -1 past min(block_topk, visible). `logits` is fp32 with
    unit column stride and `block_indices` int32 (what the indexer hands the stock kernels)."""
    rows = logits.shape[0]
    if rows == 0:
        return
    _refuse("radix", logits, block_indices)
    _radix_block_topk[(rows,)](logits, logits.stride(0), visible_blocks, block_indices, block_indices.stride(0),
                               int(columns), max(int(block_topk), 0), block_indices.shape[1], BLOCK=BLOCK)


def repair_block_topk(logits, visible_blocks, block_indices, block_topk: int, columns: int, *,
                      slice_columns: int | None = SLICE) -> None:
    """Rewrites, in place, the stock kernel's `block_indices` (the top `block_topk` columns of
    `logits[r, :visible_blocks[r]]` in any order, ties broken anyhow, -1 padded) into what
    `radix_block_topk` returns: column order, ties to the lowest column. Same argument contract.
    A stock output that is not an exact top-k fails the certificate; the row's k-th key is then
    found by radix select, so the answer is the same.

    `slice_columns`: the columns one program scans (two launches over rows x slices, the default);
    None runs the one-program-per-row pass (the reference, the bench's `repair_serial`). Both write
    the same output for any input."""
    rows = logits.shape[0]
    if rows == 0:
        return
    _refuse("repair", logits, block_indices)
    k = max(int(block_topk), 0)
    columns = int(columns)
    width = block_indices.shape[1]
    slots = triton.next_power_of_2(max(min(k, width), 1))  # the slots read, one block
    if slice_columns is None:
        _repair_serial[(rows,)](logits, logits.stride(0), visible_blocks, block_indices, block_indices.stride(0),
                                columns, k, width, SLOTS=slots, BLOCK=BLOCK)
        return
    if int(slice_columns) < 1:
        raise ValueError(f"repair top-k: slice_columns must be a positive column count or None, got {slice_columns!r}")
    import torch

    slice_columns = int(slice_columns)
    n_slices = max(triton.cdiv(columns, slice_columns), 1)  # v <= columns: every visible slice
    block = min(BLOCK, triton.next_power_of_2(slice_columns))
    # per row: t, then (above t, equal to t) per slice; a graph capture takes it from its private
    # pool, so replays need no allocation
    scratch = torch.empty((rows, 1 + 2 * n_slices), dtype=torch.int64, device=logits.device)
    args = (logits, logits.stride(0), visible_blocks, block_indices, block_indices.stride(0), scratch,
            scratch.stride(0), columns, k, width)
    _repair_count[(rows, n_slices)](*args, SLOTS=slots, SLICE=slice_columns, BLOCK=block)
    _repair_write[(rows, n_slices)](*args, MAX_S=triton.next_power_of_2(n_slices), SLICE=slice_columns, BLOCK=block)
