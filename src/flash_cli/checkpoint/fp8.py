"""128×128 block fp8 (e4m3fn) quantization of BF16 weights, numpy + ml_dtypes only.

Per block: s = max(amax|w|, 1e-12) / 448; q = e4m3fn(clip(w / s, ±448)); dequant q × s. All
math in float32, the cast round-to-nearest-even: bit-identical to torch's
`(w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)` (tests compare when torch exists).

Two implementations, bit-identical (tests): the compiled one in fp8_kernel.py (numba: fused
amax + branch-free integer e4m3 rounding, ~1–2.5 ns/element on one core of this box) and a
numpy one kept as the reference and the fallback without numba (~15 ns/element). The numpy
`cast_e4m3` gets the bytes from two 65,536-entry tables indexed by the top 16 bits of each
float32 (every rounding boundary of e4m3 lies on a multiple of 2^16 in float32 bit space),
with the exact-tie case (low 16 bits zero) fixed up from a second table. Work runs in strips
of 128 rows, so memory stays a few strips, not the tensor. inf/NaN in a block is refused
(NonFiniteError): its scale would be inf/NaN and the codes meaningless.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

BLOCK = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12
# Worst |w - q·s| / amax within a block: half an e4m3 step at the top binade [256, 448]
# (step 32) over 448. Anything above this means the math is wrong, not unlucky.
REL_ERR_BOUND = 16.0 / 448.0
STRIP_ELEMS = 4 * 1024 * 1024  # 16 MB of float32 per strip

_tables: dict[str, object] = {}
_local = threading.local()


def _e4m3_codes(x):
    """float32 → e4m3fn codes through ml_dtypes; through torch (the same RNE cast) where ml_dtypes is
    absent (the GPU device's vLLM environment has torch, not ml_dtypes). Only |x| ≤ 448 is ever used."""
    import numpy as np

    try:
        import ml_dtypes
    except ImportError:
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    with np.errstate(all="ignore"):
        return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _e4m3_values():
    import numpy as np

    codes = np.arange(256, dtype=np.uint8)
    try:
        import ml_dtypes
    except ImportError:
        import torch

        return torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _get_tables():
    if not _tables:
        import numpy as np

        top = np.arange(65536, dtype=np.uint32) << 16
        exact = _e4m3_codes(top.view(np.float32))
        above = _e4m3_codes((top | 1).view(np.float32))
        tie = exact != above
        _tables.update(
            above=above,
            exact=exact,
            tie=tie,
            # one gather gives the code (low byte) and whether it may be an exact tie (high byte)
            coded=(above.astype(np.uint16) | (tie.astype(np.uint16) << 8)),
            back=_e4m3_values(),
        )
    return _tables


def cast_e4m3(x):
    """float32 array with |x| ≤ 448 (no NaN) → uint8 e4m3fn codes, RNE like ml_dtypes/torch."""
    import numpy as np

    t = _get_tables()
    halves = np.ascontiguousarray(x).reshape(-1).view(np.uint16)
    hi = np.ascontiguousarray(halves[1::2])  # little-endian: odd halves are the top 16 bits
    coded = t["coded"][hi]
    pairs = coded.view(np.uint8)
    code = np.ascontiguousarray(pairs[0::2])
    maybe = np.flatnonzero(pairs[1::2])
    if maybe.size:
        exact = maybe[halves[0::2][maybe] == 0]
        code[exact] = t["exact"][hi[exact]]
    return code.reshape(x.shape)


_KERNEL: dict[str, object] = {}


class NonFiniteError(ValueError):
    """A block holds inf or NaN: no scale makes sense, so nothing is written for it."""


def kernel():
    """The compiled module (fp8_kernel) or None when numba is not installed: numpy path then."""
    if "m" not in _KERNEL:
        try:
            from . import fp8_kernel
        except ImportError:
            fp8_kernel = None
        _KERNEL["m"] = fp8_kernel
    return _KERNEL["m"]


def _numba_kernel():
    """Kept for callers that ask whether the compiled path is there."""
    k = kernel()
    return None if k is None else k.quantize_strip


def quantize_strip_compiled(u16, rows: int, cols: int, with_error: bool = True):
    """numba path of quantize_strip (same bytes; tests compare the two). None without numba.
    The worst error is always computed (it is ~free inside the fused loop)."""
    import numpy as np

    k = kernel()
    if k is None:
        return None
    codes = np.empty(rows * cols, dtype=np.uint8)
    scales = np.empty((rows // BLOCK, cols // BLOCK), dtype=np.float32)
    worst = k.quantize_strip(np.ascontiguousarray(u16).reshape(-1), rows, cols, codes, scales)
    if worst < 0:
        raise NonFiniteError("inf or NaN in the weights")
    return codes.reshape(rows, cols), scales, worst / FP8_MAX


@dataclass
class Converted:
    weight: bytes  # F8_E4M3, [N, K] row-major
    scale: bytes  # F32, [N/128, K/128]
    worst_rel_err: float


def _workspace(n_elems: int):
    import numpy as np

    ws = getattr(_local, "ws", None)
    if ws is None or ws.size < n_elems:
        ws = np.empty(n_elems, dtype=np.uint32)
        _local.ws = ws
    return ws[:n_elems]


def quantize_strip(u16, rows: int, cols: int, with_error: bool = True, compiled: bool | None = None):
    """BF16 bits (uint16 [rows·cols], rows % 128 == 0) → (codes, scales, worst rel err).

    Uses the numba kernel when numba is installed (~1.5 ns/element vs ~15), numpy otherwise;
    `compiled=False` forces numpy (tests compare both). Raises NonFiniteError on inf/NaN."""
    import numpy as np

    if compiled is not False:
        out = quantize_strip_compiled(u16, rows, cols, with_error)
        if out is not None:
            return out

    t = _get_tables()
    nb, kb = rows // BLOCK, cols // BLOCK
    # amax on the bf16 bits: clearing the sign gives a uint16 whose order is the float order
    a16 = (u16 & np.uint16(0x7FFF)).reshape(nb, BLOCK, kb, BLOCK).max(axis=(1, 3))
    if a16.size and int(a16.max()) >= 0x7F80:  # inf/NaN bits: no meaningful scale
        raise NonFiniteError("inf or NaN in the weights")
    amax = (a16.astype(np.uint32) << 16).view(np.float32)
    scale = (np.maximum(amax, np.float32(AMAX_FLOOR)) / np.float32(FP8_MAX)).astype(np.float32)
    ws = _workspace(rows * cols)
    ws[...] = u16
    ws <<= 16
    x = ws.view(np.float32).reshape(nb, BLOCK, kb, BLOCK)
    np.divide(x, scale[:, None, :, None], out=x)
    # No clip: |w| ≤ amax so |x| ≤ 448 up to one float32 rounding, and anything below 464 rounds
    # to 448 exactly as the clamped value does (the tables are built over every float32).
    q = cast_e4m3(x)
    worst = 0.0
    if with_error:
        back = t["back"][q]
        back -= x  # |w - q·s| / amax = |x - q| · s / amax = |x - q| / 448
        np.abs(back, out=back)
        worst = float(back.max()) / FP8_MAX if back.size else 0.0
    return q.reshape(rows, cols), scale, worst


def quantize_bf16(raw, shape: tuple[int, int], with_error: bool = True) -> Converted:
    """One BF16 tensor's bytes → fp8 bytes + F32 scale bytes. Both dims must divide by 128."""
    import numpy as np

    n, k = shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"shape {list(shape)} is not a multiple of {BLOCK}×{BLOCK}")
    u16 = np.frombuffer(raw, dtype=np.uint16)
    if u16.size != n * k:
        raise ValueError(f"{len(raw)} bytes do not hold a BF16 tensor of shape {list(shape)}")
    u16 = u16.reshape(n, k)
    strip_rows = max(BLOCK, (STRIP_ELEMS // max(k, 1)) // BLOCK * BLOCK)
    q_out = np.empty((n, k), dtype=np.uint8)
    s_out = np.empty((n // BLOCK, k // BLOCK), dtype=np.float32)
    worst = 0.0
    for r0 in range(0, n, strip_rows):
        r1 = min(n, r0 + strip_rows)
        q, s, e = quantize_strip(u16[r0:r1].reshape(-1), r1 - r0, k, with_error)
        q_out[r0:r1] = q
        s_out[r0 // BLOCK:r1 // BLOCK] = s
        worst = max(worst, e)
    return Converted(q_out.tobytes(), s_out.tobytes(), worst)


def dequantize(q_bytes, scale_bytes, shape):
    """fp8 codes + F32 block scales → float32 [N, K] (tests, checks)."""
    import numpy as np

    n, k = shape
    q = np.frombuffer(q_bytes, dtype=np.uint8).reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s = np.frombuffer(scale_bytes, dtype=np.float32).reshape(n // BLOCK, k // BLOCK)
    return (_get_tables()["back"][q] * s[:, None, :, None]).reshape(n, k)
