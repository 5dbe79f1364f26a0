"""The NVFP4 PLE codec (flash_vllm/ple/nvfp4.py) against a pure-numpy reference decode.

The reference decodes E2M1 and E4M3FN from their bit layouts (sign / exponent / mantissa formulas,
no lookup table shared with the code under test), multiplies in float32 in vLLM 0.33's CUDA order
((value x block scale) x weight_scale_2) and rounds once to the output dtype (ml_dtypes for bf16:
round to nearest even). Every one of the 256 code bytes (each of the 16 E2M1 codes as the low and
the high nibble) and every one of the 256 scale bytes (NaN 0x7F/0xFF and subnormals included) is
decoded, with ordinary, tiny, overflowing, infinite, NaN, zero and negative global scales.
The vllm tier (tests/vllm/release/check_ple_nvfp4.py) compares the same codec with vLLM's own
`Qwen4ExpPLENvFp4EmbeddingMethod` lookups.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch

from flash_common.stheader import read_header
from flash_vllm.ple import NvFp4Table, PLETable, PLEStats, Stager, open_table, synth
from flash_vllm.ple.discovery import PLETableError
from flash_vllm.ple.nvfp4 import Decoder

NG = synth.PREFIX + "ngram_embedding."
GLOBALS = [0.7, 2.0 ** -20, 1.0, 3.0e38, float("inf"), float("nan"), 0.0, -1.5]


# --- the reference ---------------------------------------------------------------------------------

def e2m1(code: np.ndarray) -> np.ndarray:
    """E2M1 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit) -> float32."""
    code = code.astype(np.int64)
    e, f = (code >> 1) & 3, code & 1
    mag = np.where(e == 0, f * 0.5, (1 + f / 2) * 2.0 ** (e - 1))
    return np.where(code & 8, -mag, mag).astype(np.float32)


def e4m3fn(byte: np.ndarray) -> np.ndarray:
    """E4M3FN (bias 7, no infinities, S.1111.111 NaN) -> float32."""
    b = byte.astype(np.int64)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


def reference(rows: np.ndarray, g: float) -> np.ndarray:
    """(n, w/2 + w/16) uint8 rows -> float32 (n, w)."""
    n, rb = rows.shape
    cb = rb * 8 // 9
    codes = rows[:, :cb]
    vals = np.empty((n, 2 * cb), np.float32)
    vals[:, 0::2] = e2m1(codes & 15)  # low nibble: the even element
    vals[:, 1::2] = e2m1(codes >> 4)
    scales = e4m3fn(rows[:, cb:])
    with np.errstate(all="ignore"):
        out = (vals.reshape(n, -1, 16) * scales[:, :, None]) * np.float32(g)
    return out.reshape(n, 2 * cb)


def as_dtype(ref32: np.ndarray, dtype) -> np.ndarray:
    with np.errstate(over="ignore"):  # overflow to inf is the expected rounding
        if dtype == torch.bfloat16:
            return ref32.astype(ml_dtypes.bfloat16)
        return ref32.astype({torch.float16: np.float16, torch.float32: np.float32}[dtype])


def assert_same(got: torch.Tensor, want: np.ndarray):
    """Bit-identical, NaNs at the same places (NaN payloads are not compared)."""
    g = got.float().numpy() if got.dtype == torch.bfloat16 else got.numpy()
    w = want.astype(np.float32)
    assert np.array_equal(np.isnan(g), np.isnan(w))
    ok = ~np.isnan(w)
    bits = {torch.bfloat16: np.uint16, torch.float16: np.uint16, torch.float32: np.uint32}[got.dtype]
    gb = got.view({torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[got.dtype])
    assert np.array_equal(gb.numpy().view(bits)[ok], want.view(bits)[ok])


def every_byte_rows() -> np.ndarray:
    """256 rows of 32 values (16 code bytes + 2 scale bytes): every code byte in every position of
    some row and every scale byte as each row's first block scale."""
    i = np.arange(256)
    codes = (i[:, None] + np.arange(16)[None, :] * 17) % 256
    scales = np.stack([i, (i * 7 + 3) % 256], axis=1)
    return np.concatenate([codes, scales], axis=1).astype(np.uint8)


# --- the device decoder ----------------------------------------------------------------------------

def test_the_reference_agrees_with_ml_dtypes_and_covers_every_code():
    b = np.arange(256, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = e4m3fn(b)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).sum() == 2  # 0x7F, 0xFF
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert e2m1(np.arange(16)).tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    rows = every_byte_rows()
    assert set(rows[:, :16].reshape(-1).tolist()) == set(range(256))
    assert set(rows[:, 16].tolist()) == set(range(256))


@pytest.mark.parametrize("g", GLOBALS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decoder_equals_the_numpy_reference_bit_for_bit(g, dtype):
    rows = every_byte_rows()
    dec = Decoder("cpu", 16, g)
    got = dec.decode(torch.from_numpy(rows)).to(dtype)
    assert got.shape == (256, 32)
    assert_same(got, as_dtype(reference(rows, g), dtype))


def test_nan_and_inf_follow_vllms_cuda_lookup():
    """Semantics of `_lookup_nvfp4_ple_embedding_kernel` (value * scale * global, left to right)."""
    codes = np.array([0x00, 0x08, 0x71, 0x7F, 0xA2, 0x33, 0x44, 0x55,  # 32 values, 2 blocks
                      0x66, 0x77, 0x88, 0x99, 0xAA, 0xBB, 0xCC, 0xDD], np.uint8)
    row = lambda s0, s1: np.concatenate([codes, [s0, s1]]).astype(np.uint8)[None]  # noqa: E731
    dec = lambda g: Decoder("cpu", 16, g)  # noqa: E731
    # a NaN block scale (0x7F, or 0xFF with the sign) makes its whole block NaN, zero codes included
    for nan in (0x7F, 0xFF):
        out = dec(1.0).decode(torch.from_numpy(row(0x38, nan)))[0]  # block 0 scale 1.0, block 1 NaN
        assert out[16:].isnan().all() and not out[:16].isnan().any()
    # an infinite global scale: 0 x inf = NaN, the rest +-inf
    out = dec(float("inf")).decode(torch.from_numpy(row(0x38, 0x38)))[0]  # scale 1.0
    zero = torch.tensor([v == 0 for v in e2m1(np.stack([codes & 15, codes >> 4], 1).reshape(-1)).tolist()])
    assert out[zero].isnan().all() and out[~zero].isinf().all()
    assert dec(float("nan")).decode(torch.from_numpy(row(0x38, 0x38))).isnan().all()
    # value x scale first: a zero code stays 0 where scale x global alone would overflow to inf
    big = dec(3.0e38).decode(torch.from_numpy(row(0x7E, 0x7E)))[0]  # scale 448
    assert big[0].item() == 0.0 and big[4].item() == float("inf")  # code 0; code 1 (0.5): 0.5*448*3e38
    # E2M1 code 8 is negative zero, kept through the scales
    nz = dec(0.5).decode(torch.from_numpy(row(0x38, 0x38)))[0]
    assert nz[2].item() == 0.0 and torch.signbit(nz[2])  # 0x08 low nibble


# --- the host table --------------------------------------------------------------------------------

def _raw(directory, name) -> np.ndarray:
    """A 2-D tensor's bytes, straight from its file's header offsets (independent of the engine)."""
    d = os.fspath(directory)
    wmap = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    t = read_header(os.path.join(d, wmap[name])).tensors[name]
    rows = t.shape[0]
    return np.fromfile(os.path.join(d, wmap[name]), np.uint8, count=t.nbytes, offset=t.begin).reshape(rows, -1)


def reference_rows(directory, num_shards, ids) -> np.ndarray:
    codes = np.concatenate([_raw(directory, f"{NG}shard_{k}.weight") for k in range(num_shards)])
    scales = np.concatenate([_raw(directory, f"{NG}shard_{k}.weight_scale") for k in range(num_shards)])
    ids = np.asarray(ids).reshape(-1)
    return np.concatenate([codes[ids], scales[ids]], axis=1)


@pytest.fixture(scope="module", params=["radixark", "nvidia", "apart"])
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"nvfp4-{request.param}")
    layout = "radixark" if request.param == "apart" else request.param
    synth.write_checkpoint(d, layout=layout, rows_per_shard=40, num_shards=5, last_rows=13, dtype="NVFP4",
                           width=32, scale=0.0375, per_file=2, scales_apart=request.param == "apart")
    return d


def test_open_table_reads_the_nvfp4_layout(ckpt):
    with open_table(ckpt, layer=1) as t:
        assert isinstance(t, NvFp4Table) and t.dtype == "NVFP4" and t.scale is None
        assert (t.num_rows, t.rows_per_shard, t.num_shards) == (4 * 40 + 13, 40, 5)
        assert (t.head_dim, t.code_bytes, t.scale_bytes, t.row_bytes) == (32, 16, 2, 18)
        assert t.global_scale == float(np.float32(0.0375))
        assert "NVFP4" in t.describe() and "18 B" in t.describe()
    if "apart" in str(ckpt):  # the point of that variant: codes and scales resolved from other files
        wmap = json.load(open(ckpt / "model.safetensors.index.json"))["weight_map"]
        assert wmap[f"{NG}shard_0.weight"] != wmap[f"{NG}shard_0.weight_scale"]


def test_gathers_are_the_codes_then_the_block_scales_of_each_row(ckpt):
    rng = np.random.default_rng(3)
    st = PLEStats(stats_sec=0, prometheus=False)
    with NvFp4Table.from_checkpoint(ckpt, layer=1, stats=st) as t:
        for n in (1, 7, 300, 5000):  # 5000: the deduplicating path
            ids = rng.integers(0, t.num_rows, size=n)
            ids[0] = t.num_rows - 1  # a row of the partial last shard
            assert np.array_equal(t.gather(ids), reference_rows(ckpt, 5, ids))
        urows, inv = t.gather_unique(ids)
        assert np.array_equal(urows[inv], reference_rows(ckpt, 5, ids))
        with pytest.raises(IndexError, match=str(t.num_rows)):
            t.gather(np.array([0, t.num_rows]))
        snap = st.snapshot()["total"]
        assert snap["rows"] >= 1 + 7 + 300 and snap["bytes"] == snap["rows"] * 18


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stager_decodes_looked_up_rows_like_the_reference(ckpt, dtype):
    rng = np.random.default_rng(4)
    with open_table(ckpt, layer=1) as t:
        for dedup_min in (1025, 8):  # the per-row path and the deduplicated one (inverse on the device)
            st = Stager(t, "cpu", out_dtype=dtype, dedup_min=dedup_min)
            ids = rng.integers(0, t.num_rows, size=(37, 4))
            got = st.lookup(ids)
            assert got.shape == (37, 4, 32) and got.dtype == dtype
            want = as_dtype(reference(reference_rows(ckpt, 5, ids), t.global_scale), dtype).reshape(37, 4, 32)
            assert_same(got, want)
            out = torch.empty(37, 4, 32, dtype=dtype)
            assert st.lookup(ids, out=out) is out
            assert_same(out, want)
        with pytest.raises(ValueError, match="no raw"):
            st.lookup(ids, raw=True)


def test_real_row_width_is_90_bytes(tmp_path):
    """Qwen3.8-Flash-Next's rows (160 values): 80 code + 10 scale bytes, 90/320 of a BF16 row."""
    synth.write_checkpoint(tmp_path, layout="nvidia", rows_per_shard=8, num_shards=2, dtype="NVFP4", width=160)
    with open_table(tmp_path) as t:
        assert (t.code_bytes, t.scale_bytes, t.row_bytes) == (80, 10, 90)
        assert t.row_bytes / (160 * 2) == 0.28125 and t.row_bytes / 160 == 0.5625  # vs BF16/F16, FP8 rows
        st = Stager(t, "cpu", out_dtype=torch.bfloat16)
        ids = np.arange(16).reshape(4, 4)
        want = as_dtype(reference(reference_rows(tmp_path, 2, ids), t.global_scale), torch.bfloat16)
        assert_same(st.lookup(ids).reshape(16, 160), want)


def test_fp8_checkpoints_still_open_as_row_tables(tmp_path):
    synth.write_checkpoint(tmp_path, layout="nvidia", rows_per_shard=8, num_shards=2, width=16)
    with open_table(tmp_path) as t:
        assert type(t) is PLETable and t.dtype == "F8_E4M3"


def _edit_index(d, drop=None, add=None):
    p = d / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    for k in drop or ():
        del idx["weight_map"][k]
    idx["weight_map"].update(add or {})
    p.write_text(json.dumps(idx))


def test_an_incomplete_nvfp4_table_is_refused_naming_what_is_missing(tmp_path):
    def fresh(name, **kw):
        d = tmp_path / name
        synth.write_checkpoint(d, layout="nvidia", rows_per_shard=8, num_shards=3, dtype="NVFP4", width=32, **kw)
        return d

    d = fresh("noscale")
    _edit_index(d, drop=[f"{NG}shard_1.weight_scale"])
    with pytest.raises(PLETableError, match=r"shard_1\.weight has no shard_1\.weight_scale"):
        open_table(d)
    d = fresh("noglobal", scale=None)
    with pytest.raises(PLETableError, match="weight_scale_2"):
        open_table(d)
    # block scales of the wrong width (one per 8 values): refused, not decoded as garbage
    d = tmp_path / "width"
    synth.write_checkpoint(d, layout="nvidia", rows_per_shard=8, num_shards=2, dtype="NVFP4", width=32)
    other = tmp_path / "other"
    synth.write_checkpoint(other, layout="nvidia", rows_per_shard=8, num_shards=2, dtype="NVFP4", width=64)
    name = "model-fp8-mtp-ple.safetensors"
    os.replace(other / name, d / "other.safetensors")
    _edit_index(d, add={f"{NG}shard_1.weight_scale": "other.safetensors"})
    with pytest.raises(PLETableError, match="F8_E4M3 x 4 but shard 0 is F8_E4M3 x 2"):
        open_table(d)
