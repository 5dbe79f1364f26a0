"""numba kernel for fp8.py: fused 128×128 block amax + e4m3fn cast, branch-free and table-free.

Imported only through `fp8.kernel()`, which falls back to the numpy path when numba is missing.
The cast is the integer formulation torch's CPU cast uses (c10 `fp8e4m3fn_from_fp32_value`) on
the already clamped |x| ≤ 448, written as LLVM IR so every step stays 32-bit (numba widens its
own integer arithmetic to 64 bits, which halves the SIMD lanes):

- normal range (|x| ≥ 2^-6): add 0x7FFFF + the lowest kept mantissa bit to the float32 bits
  (round to nearest, ties to even, at bit 20), shift right 20, rebias 127 → 7;
- subnormal range: |x| + 2^14 in float32 puts the e4m3 subnormal step (2^-9) on the float32
  ulp, so the FPU's own round-to-nearest-even does the rounding; the mantissa is the code.

Both paths are computed and one selected, so the loop vectorizes (AVX2: 8 lanes). The block
amax is an integer max over the BF16 bits with the sign cleared (same order as |w|), the
worst-error reduction an integer max over the bits of non-negative floats (vectorizes without
fast-math, which must stay off: it would turn w / s into w · (1/s) and change bytes).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
F32_448 = 0x43E00000  # float32 bits of 448.0, the largest finite e4m3fn
NONFINITE_BF16 = 0x7F80  # |bits| at or above this is inf or NaN


def _c(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


@intrinsic
def _quant(typingctx, x):
    """float32 x (|x| may exceed 448 by rounding; clamped here) → (signed e4m3fn code,
    float32 bits of | |x| − |dequantized code| |)."""
    if x != types.float32:
        return None
    sig = types.UniTuple(types.uint32, 2)(types.float32)

    def codegen(context, b, signature, args):
        xb = b.bitcast(args[0], _I32)
        sign = b.and_(b.lshr(xb, _c(24)), _c(0x80))
        ab = b.and_(xb, _c(0x7FFFFFFF))
        cb = b.select(b.icmp_unsigned("<", ab, _c(F32_448)), ab, _c(F32_448))  # clamp(±448)
        odd = b.and_(b.lshr(cb, _c(20)), _c(1))
        normal = b.sub(b.lshr(b.add(b.add(cb, _c(0x7FFFF)), odd), _c(20)), _c((127 - 7) << 3))
        biased = b.fadd(b.bitcast(cb, _F32), ir.Constant(_F32, 16384.0))
        subnormal = b.sub(b.bitcast(biased, _I32), _c((127 + 14) << 23))
        code = b.select(b.icmp_unsigned(">=", cb, _c((127 - 6) << 23)), normal, subnormal)
        deq_normal = b.bitcast(b.add(b.shl(code, _c(20)), _c((127 - 7) << 23)), _F32)
        deq_sub = b.fmul(b.uitofp(code, _F32), ir.Constant(_F32, 1.0 / 512))
        deq = b.select(b.icmp_unsigned(">=", code, _c(8)), deq_normal, deq_sub)
        err = b.and_(b.bitcast(b.fsub(b.bitcast(ab, _F32), deq), _I32), _c(0x7FFFFFFF))
        return context.make_tuple(b, signature.return_type, [b.or_(code, sign), err])

    return sig, codegen


@intrinsic
def _bf16_to_f32(typingctx, u):
    """BF16 bits (any integer type holding them) → float32."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, b, signature, args):
        v = args[0]
        if u.bitwidth > 32:
            v = b.trunc(v, _I32)
        elif u.bitwidth < 32:
            v = b.zext(v, _I32)
        return b.bitcast(b.shl(v, _c(16)), _F32)

    return types.float32(u), codegen


@intrinsic
def _mag16(typingctx, u):
    """BF16 bits with the sign cleared, kept 16-bit."""
    if u != types.uint16:
        return None

    def codegen(context, b, signature, args):
        return b.and_(args[0], ir.Constant(_I16, 0x7FFF))

    return types.uint16(types.uint16), codegen


@intrinsic
def _bits_to_f32(typingctx, u):
    if u != types.uint32:
        return None

    def codegen(context, b, signature, args):
        return b.bitcast(args[0], _F32)

    return types.float32(types.uint32), codegen


def _jit(fn):
    """njit with the on-disk cache (compiled once per machine, ~3 s); numba raises at decoration
    when no cache location is writable, and then we compile per process instead."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:
        return numba.njit(cache=False, nogil=True)(fn)


def _quantize_strip(u16, rows, cols, codes, scales):  # pragma: no cover - compiled
    """u16: BF16 bits [rows·cols]; rows % 128 == cols % 128 == 0. Fills codes [rows·cols] and
    scales [rows/128, cols/128]; returns the worst |x − q| (≤ 16 when right: /448 = rel err),
    or -1.0 when a block holds inf/NaN (nothing meaningful can be written)."""
    kb = cols // 128
    worst = np.uint32(0)
    amax = np.empty(kb, dtype=np.uint16)
    scale = np.empty(kb, dtype=np.float32)
    for bi in range(rows // 128):
        amax[:] = 0
        for r in range(bi * 128, bi * 128 + 128):  # pass 1 over the band, row-major
            for bj in range(kb):
                seg = u16[r * cols + bj * 128: r * cols + bj * 128 + 128]
                m = amax[bj]
                for c in range(128):
                    m = max(m, _mag16(seg[c]))
                amax[bj] = m
        for bj in range(kb):
            if amax[bj] >= NONFINITE_BF16:
                return -1.0
            s = np.float32(max(_bf16_to_f32(amax[bj]), np.float32(1e-12)) / np.float32(448.0))
            scale[bj] = s
            scales[bi, bj] = s
        for r in range(bi * 128, bi * 128 + 128):  # pass 2 while the band is still in cache
            for bj in range(kb):
                s = scale[bj]
                seg = u16[r * cols + bj * 128: r * cols + bj * 128 + 128]
                out = codes[r * cols + bj * 128: r * cols + bj * 128 + 128]
                for c in range(128):
                    code, err = _quant(_bf16_to_f32(seg[c]) / s)
                    out[c] = np.uint8(code)
                    worst = max(worst, err)
    return np.float64(_bits_to_f32(worst))


def _cast(x, codes):  # pragma: no cover - compiled
    """float32 [n] → e4m3fn codes of clamp(x, ±448) (the cast alone; tests hit every boundary)."""
    for i in range(x.size):
        code, err = _quant(x[i])
        codes[i] = np.uint8(code)


quantize_strip = _jit(_quantize_strip)
cast = _jit(_cast)
