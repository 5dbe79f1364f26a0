"""fp8 block math: bit-identical to ml_dtypes and torch casts, error within the e4m3 bound."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flash_cli.checkpoint import fp8


def _bf16(a):
    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16)


def _boundaries():
    """All e4m3 values, the midpoints between neighbours (exact ties: RNE decides), ±1 ulp around
    them, powers of two deep into the subnormals, ±0, and 200k random values; clipped to ±448."""
    vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    vals = np.unique(vals[np.isfinite(vals)])
    mids = (vals[:-1] + vals[1:]) / 2
    around = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), vals,
                             np.float32(2.0) ** -np.arange(6, 30, dtype=np.float32)])
    x = np.clip(np.concatenate([around, -around, [0.0, -0.0]]).astype(np.float32), -448, 448)
    rng = np.random.default_rng(1)
    return np.concatenate([x, np.clip(rng.standard_normal(200_000).astype(np.float32) * 100, -448, 448)])


def test_lut_cast_equals_ml_dtypes_on_every_boundary():
    x = _boundaries()
    assert np.array_equal(fp8.cast_e4m3(x), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def _kernel():
    k = fp8.kernel()
    if k is None:
        pytest.fail("numba is a pinned cli dependency and must be importable")
    return k


def test_compiled_cast_equals_ml_dtypes_on_every_boundary():
    x = _boundaries()
    codes = np.empty(x.size, dtype=np.uint8)
    _kernel().cast(x, codes)
    assert np.array_equal(codes, x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert codes[x.size - 200_000 - 2] == 0x00 and codes[x.size - 200_000 - 1] == 0x80  # +0 and -0 keep their sign


def test_quantize_matches_reference_formula_and_bound():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((384, 256)).astype(np.float32) * 0.02
    w[0, :7] = 0
    w[200, 3] = 5.0  # an outlier owns its block's scale
    w[256:384, 128:256] = 0  # an all-zero block: amax floor, codes 0, exact
    wb = _bf16(w)
    c = fp8.quantize_bf16(wb.tobytes(), wb.shape)
    wf = wb.astype(np.float32).reshape(3, 128, 2, 128)
    amax = np.maximum(np.abs(wf).max(axis=(1, 3)), np.float32(1e-12))
    s = (amax / np.float32(448)).astype(np.float32)
    ref = np.clip(wf / s[:, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert c.weight == ref.reshape(384, 256).tobytes()
    assert c.scale == s.tobytes()
    back = fp8.dequantize(c.weight, c.scale, (384, 256))
    err = np.abs(back - wb.astype(np.float32)).reshape(3, 128, 2, 128).max(axis=(1, 3)) / amax
    assert float(err.max()) <= fp8.REL_ERR_BOUND * (1 + 1e-5)
    assert abs(c.worst_rel_err - float(err.max())) < 1e-5
    assert np.all(back[256:, 128:] == 0)


def test_bit_identical_to_torch_when_available():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    wb = _bf16(rng.standard_normal((256, 384)) * 0.05)
    c = fp8.quantize_bf16(wb.tobytes(), wb.shape)
    t = torch.from_numpy(wb.view(np.int16).copy()).view(torch.bfloat16).float().reshape(2, 128, 3, 128)
    s = t.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (t / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert q.view(torch.uint8).reshape(256, 384).numpy().tobytes() == c.weight
    assert s.numpy().astype(np.float32).tobytes() == c.scale


def test_strips_do_not_change_results(monkeypatch):
    rng = np.random.default_rng(4)
    wb = _bf16(rng.standard_normal((1024, 256)))
    whole = fp8.quantize_bf16(wb.tobytes(), wb.shape)
    monkeypatch.setattr(fp8, "STRIP_ELEMS", 128 * 256)  # one block row per strip
    assert fp8.quantize_bf16(wb.tobytes(), wb.shape) == whole


def test_values_a_rounding_above_448_cast_like_the_clamped_value():
    # quantize_strip skips the clamp: w/s can exceed 448 by an ulp; it must still give 448's code
    x = np.array([448, np.nextafter(np.float32(448), np.float32(500)), 455.9, 463.9], dtype=np.float32)
    x = np.concatenate([x, -x])
    assert np.array_equal(fp8.cast_e4m3(x), np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@pytest.mark.parametrize("shape", [(100, 256), (256, 100)])
def test_unaligned_shape_is_refused(shape):
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize_bf16(b"\0" * (shape[0] * shape[1] * 2), shape)


@pytest.mark.parametrize("data", ["normal", "zeros", "ties", "outliers"])
def test_compiled_kernel_is_bit_identical_to_numpy(data):
    _kernel()
    rows, cols = 384, 512
    rng = np.random.default_rng(7)
    if data == "normal":
        w = rng.standard_normal((rows, cols)) * 0.02
    elif data == "zeros":
        w = np.zeros((rows, cols))
    elif data == "ties":  # values that land exactly on e4m3 rounding midpoints after scaling
        w = (np.arange(rows * cols) % 97).reshape(rows, cols) * (448 / 96.0) / 2**10
    else:
        w = rng.standard_normal((rows, cols)) * 1e-30
        w[::7, ::5] = 1e30
    u16 = _bf16(w).view(np.uint16).reshape(-1)
    a = fp8.quantize_strip(u16, rows, cols, compiled=False)
    b = fp8.quantize_strip(u16, rows, cols)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    assert abs(a[2] - b[2]) < 1e-6


def _reference(wb):
    """torch's recipe in numpy + ml_dtypes: amax per block, s = max(amax, 1e-12) / 448,
    e4m3fn(clamp(w / s, ±448))."""
    n, k = wb.shape
    wf = wb.astype(np.float32).reshape(n // 128, 128, k // 128, 128)
    s = (np.maximum(np.abs(wf).max(axis=(1, 3)), np.float32(1e-12)) / np.float32(448)).astype(np.float32)
    q = np.clip(wf / s[:, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return q.reshape(n, k), s


def test_every_finite_bf16_value_in_blocks_of_every_scale():
    # all 65,280 finite BF16 bit patterns (± subnormals, ±0, up to ±max), shuffled into 256×256 so
    # each block gets a different amax and subnormal/tie/max codes all occur; both paths vs torch's recipe
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    bits = bits[(bits & 0x7FFF) < 0x7F80]
    rng = np.random.default_rng(11)
    u16 = np.concatenate([bits, rng.choice(bits, 65536 - bits.size)])
    rng.shuffle(u16)
    u16 = u16.reshape(256, 256)
    u16[:128, :128] &= np.uint16(0x80FF)  # one block of tiny values only (subnormal bf16 and below)
    u16[128:, 128:] >>= 4  # one block of small normal values
    wb = u16.view(ml_dtypes.bfloat16)
    q, s = _reference(wb)
    for compiled in (True, False):
        got = fp8.quantize_strip(u16.reshape(-1).copy(), 256, 256, compiled=compiled)
        assert got[0].tobytes() == q.tobytes() and got[1].tobytes() == s.tobytes(), compiled
        assert got[2] <= fp8.REL_ERR_BOUND * (1 + 1e-5)


@pytest.mark.parametrize("case", ["max", "ties", "signed_zero", "subnormal_codes", "amax_floor"])
def test_compiled_edge_cases_match_the_reference(case):
    w = np.zeros((128, 256), dtype=np.float32)
    if case == "max":  # ±amax → ±448 (0x7E / 0xFE), and the values just under it
        w[0, :4] = [3.0, -3.0, np.nextafter(np.float32(3), np.float32(0)), -2.99]
        w[:, 128:] = -7.5
    elif case == "ties":  # amax 448 ⇒ s = 1: w itself is cast; midpoints between e4m3 neighbours
        v = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        v = np.unique(v[np.isfinite(v) & (v >= 0)])
        mids = ((v[:-1] + v[1:]) / 2)
        w.reshape(-1)[: mids.size] = mids
        w.reshape(-1)[mids.size: 2 * mids.size] = -mids
        w[0, 255], w[0, 0] = 448, 448
    elif case == "signed_zero":
        w[::2, ::3] = -0.0
        w[5, 5], w[6, 200] = 1.0, 1.0
    elif case == "subnormal_codes":  # w/s in e4m3's subnormal range [2^-9, 2^-6) and its ties
        w[0, 0] = w[0, 128] = 448
        w[1, :64] = np.arange(64, dtype=np.float32) * np.float32(2.0 ** -10)
        w[2, 128:192] = -np.arange(64, dtype=np.float32) * np.float32(2.0 ** -10)
    else:  # every |w| ≤ 1e-12·…: the scale is the floor, codes still exact
        w[3, 3], w[4, 130] = 1e-14, -2e-13
    wb = w.astype(ml_dtypes.bfloat16)
    q, s = _reference(wb)
    u16 = wb.view(np.uint16).reshape(-1)
    for compiled in (True, False):
        got = fp8.quantize_strip(u16, 128, 256, compiled=compiled)
        assert got[0].tobytes() == q.tobytes() and got[1].tobytes() == s.tobytes(), compiled
    if case == "max":
        assert q[0, 0] == 0x7E and q[0, 1] == 0xFE and q[5, 200] == 0xFE
    if case == "signed_zero":
        assert q[0, 0] == 0x80 and q[1, 1] == 0x00


@pytest.mark.parametrize("bits", [0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81], ids=["inf", "-inf", "nan", "-nan", "snan"])
def test_non_finite_is_refused_by_both_paths(bits):
    u16 = np.zeros(128 * 256, dtype=np.uint16)
    u16[128 * 256 - 1] = bits
    for compiled in (True, False):
        with pytest.raises(fp8.NonFiniteError):
            fp8.quantize_strip(u16, 128, 256, compiled=compiled)


def test_without_numba_the_numpy_path_gives_the_same_bytes(tmp_path):
    # a fresh interpreter where `import numba` fails: kernel() is None, results identical
    rng = np.random.default_rng(5)
    wb = _bf16(rng.standard_normal((256, 384)) * 0.03)
    (tmp_path / "w.bin").write_bytes(wb.tobytes())
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name == 'numba' or name.startswith('numba.'): raise ImportError('no numba here')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n"
        "from flash_cli.checkpoint import fp8\n"
        "assert fp8.kernel() is None\n"
        "c = fp8.quantize_bf16(open(sys.argv[1], 'rb').read(), (256, 384))\n"
        "sys.stdout.buffer.write(c.weight + c.scale)\n"
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "w.bin")], capture_output=True, check=True).stdout
    c = fp8.quantize_bf16(wb.tobytes(), (256, 384))
    assert fp8.kernel() is not None and out == c.weight + c.scale


def test_kernel_compiles_without_a_writable_cache(monkeypatch):
    # numba raises at decoration when no cache location is writable: _jit falls back to no cache
    k = _kernel()
    import numba

    real = numba.njit

    def njit(*a, **kw):
        if kw.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return real(*a, **kw)

    monkeypatch.setattr(numba, "njit", njit)

    def add(a, b):
        return a + b

    f = k._jit(add)
    assert f(2, 3) == 5 and not f._cache.__class__.__name__ == "FunctionCache"


def test_compiled_cast_equals_torch_over_float32_bit_patterns():
    # every 1021st float32 bit pattern with |x| ≤ 448, both signs (~2.2M values); the full sweep,
    # all 2,277,507,074 of them, runs with FLASH_FP8_EXHAUSTIVE=1 (~2 min here; 0 mismatches on 2026-11-30)
    import os

    torch = pytest.importorskip("torch")
    stride = 1 if os.environ.get("FLASH_FP8_EXHAUSTIVE") == "1" else 1021
    k, lim, step = _kernel(), 0x43E00000, 1 << 25
    codes = np.empty(step, dtype=np.uint8)
    for start in range(0, lim + 1, step * stride):
        bits = np.arange(start, min(lim + 1, start + step * stride), stride, dtype=np.uint32)
        for sign in (0, 0x80000000):
            x = (bits | np.uint32(sign)).view(np.float32)
            c = codes[: x.size]
            k.cast(x, c)
            ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            assert np.array_equal(c, ref), hex(int((bits | np.uint32(sign))[np.flatnonzero(c != ref)[0]]))



def test_torch_fallback_tables_equal_ml_dtypes_where_used(monkeypatch):
    """Without ml_dtypes (the GPU device's vLLM env) the cast tables come from torch: the same codes
    for every float32 the quantizer can feed (|x| <= 448, finite), so the same fp8 bytes."""
    import sys

    import numpy as np

    from flash_cli.checkpoint import fp8

    x = np.random.default_rng(0).uniform(-448, 448, 100_000).astype(np.float32)
    fp8._tables.clear()
    want = {k: v.copy() for k, v in fp8._get_tables().items()}
    want_codes = fp8.cast_e4m3(x)
    fp8._tables.clear()
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes -> ImportError
    try:
        got = fp8._get_tables()
        top = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
        used = np.isfinite(top) & (np.abs(top) <= 448)
        for k in ("exact", "above", "tie", "coded"):
            assert np.array_equal(got[k][used], want[k][used]), k
        finite = np.isfinite(want["back"])
        assert np.array_equal(got["back"][finite], want["back"][finite])
        assert np.array_equal(fp8.cast_e4m3(x), want_codes)
    finally:
        fp8._tables.clear()
