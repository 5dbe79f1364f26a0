"""128×128 block fp8 (e4m3fn) quantization of BF16 weights, numpy + ml_dtypes only.

Per block: s = max(amax|w|, 1e-12) / 448; q = e4m3fn(clip(w / s, ±448)); dequant q × s. All
math in float32, the cast round-to-nearest-even: bit-identical to torch's
`(w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)` (tests compare when torch exists).

Speed: ml_dtypes' cast costs ~15 ns/element, most of the conversion time. `cast_e4m3` gets the
same bytes from two 65,536-entry tables indexed by the top 16 bits of each float32 (every
rounding boundary of e4m3 lies on a multiple of 2^16 in float32 bit space), with the exact-tie
case (low 16 bits zero) fixed up from a second table. Work runs in strips of 128 rows with
per-thread reusable buffers, so memory stays a few strips, not the tensor.
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


def _get_tables():
    if not _tables:
        import ml_dtypes
        import numpy as np

        top = np.arange(65536, dtype=np.uint32) << 16
        with np.errstate(all="ignore"):
            exact = top.view(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            above = (top | 1).view(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        tie = exact != above
        _tables.update(
            above=above,
            exact=exact,
            tie=tie,
            # one gather gives the code (low byte) and whether it may be an exact tie (high byte)
            coded=(above.astype(np.uint16) | (tie.astype(np.uint16) << 8)),
            back=np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32),
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


_NB = {}


def _numba_kernel():
    """The same math compiled with numba (cache=True: compiled once per machine). None if absent."""
    if "k" in _NB:
        return _NB["k"]
    try:
        import numba
        import numpy as np
    except ImportError:
        _NB["k"] = None
        return None

    @numba.njit(cache=True, nogil=True)
    def kern(u16, rows, cols, above, exact, tie, back, ws, codes, scales, with_error):  # pragma: no cover - compiled
        nbr = rows // 128
        kb = cols // 128
        one = np.empty(1, dtype=np.uint32)
        onef = one.view(np.float32)
        for bi in range(nbr):
            for bj in range(kb):
                m = 0
                for r in range(bi * 128, bi * 128 + 128):
                    base = r * cols + bj * 128
                    for c in range(128):
                        v = u16[base + c] & 0x7FFF
                        if v > m:
                            m = v
                one[0] = np.uint32(m) << np.uint32(16)
                a = onef[0]
                if a < np.float32(1e-12):
                    a = np.float32(1e-12)
                scales[bi, bj] = np.float32(a / np.float32(448.0))
        n = rows * cols
        for i in range(n):
            ws[i] = np.uint32(u16[i]) << np.uint32(16)
        wf = ws.view(np.float32)
        for r in range(rows):
            bi = r // 128
            for c in range(cols):
                i = r * cols + c
                wf[i] = np.float32(wf[i] / scales[bi, c // 128])
        worst = np.float32(0.0)
        for i in range(n):
            u = ws[i]
            hi = u >> np.uint32(16)
            code = above[hi]
            if tie[hi] and (u & np.uint32(0xFFFF)) == 0:
                code = exact[hi]
            codes[i] = code
            if with_error:
                e = back[code] - wf[i]
                if e < 0:
                    e = -e
                if e > worst:
                    worst = e
        return worst

    _NB["k"] = kern
    return kern


def quantize_strip_compiled(u16, rows: int, cols: int, with_error: bool = True):
    """numba path of quantize_strip (same bytes; tests compare the two). None without numba."""
    import numpy as np

    kern = _numba_kernel()
    if kern is None:
        return None
    t = _get_tables()
    ws = _workspace(rows * cols)
    codes = np.empty(rows * cols, dtype=np.uint8)
    scales = np.empty((rows // BLOCK, cols // BLOCK), dtype=np.float32)
    worst = kern(np.ascontiguousarray(u16), rows, cols, t["above"], t["exact"], t["tie"], t["back"], ws, codes,
                 scales, with_error)
    return codes.reshape(rows, cols), scales, float(worst) / FP8_MAX


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

    Uses the numba kernel when numba is installed (several times faster), numpy otherwise;
    `compiled=False` forces numpy (tests compare both)."""
    import numpy as np

    if compiled is not False:
        out = quantize_strip_compiled(u16, rows, cols, with_error)
        if out is not None:
            return out

    t = _get_tables()
    nb, kb = rows // BLOCK, cols // BLOCK
    # amax on the bf16 bits: clearing the sign gives a uint16 whose order is the float order
    a16 = (u16 & np.uint16(0x7FFF)).reshape(nb, BLOCK, kb, BLOCK).max(axis=(1, 3))
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
