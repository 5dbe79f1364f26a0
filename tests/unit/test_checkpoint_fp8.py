"""fp8 block math: bit-identical to ml_dtypes and torch casts, error within the e4m3 bound."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flash_cli.checkpoint import fp8


def _bf16(a):
    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16)


def test_lut_cast_equals_ml_dtypes_on_every_boundary():
    # all e4m3 values, the midpoints between neighbours (exact ties: RNE decides), and ±1 ulp around them
    vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    vals = np.unique(vals[np.isfinite(vals)])
    mids = (vals[:-1] + vals[1:]) / 2
    around = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), vals,
                             np.float32(2.0) ** -np.arange(6, 30, dtype=np.float32)])
    x = np.clip(np.concatenate([around, -around, [0.0, -0.0]]).astype(np.float32), -448, 448)
    rng = np.random.default_rng(1)
    x = np.concatenate([x, np.clip(rng.standard_normal(200_000).astype(np.float32) * 100, -448, 448)])
    assert np.array_equal(fp8.cast_e4m3(x), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


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
    if fp8._numba_kernel() is None:
        pytest.fail("numba is a pinned cli dependency and must be importable")
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
