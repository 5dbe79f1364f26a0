"""PLE native loops (numba) vs their numpy twins, and the O_DIRECT cold path with its doorkeeper."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from flash_vllm.ple import native
from flash_vllm.ple.config import PLEConfig, config_from_env
from flash_vllm.ple.synth import reference_rows, write_checkpoint
from flash_vllm.ple.table import PAGE, PLETable
from ple_io import direct_missing, skip_unless_available

RPS, NSH, LAST = 997, 20, 311


@pytest.fixture(scope="module", params=["radixark", "nvidia"])
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("n" + request.param)
    write_checkpoint(d, layout=request.param, rows_per_shard=RPS, num_shards=NSH, last_rows=LAST, per_file=3)
    for f in d.iterdir():  # dirty pages cannot be dropped: the cold paths need a clean page cache
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return d


def _ids(rng, n, num_rows):
    ids = rng.integers(0, num_rows, n)
    ids[: n // 4] = ids[n // 4 : 2 * (n // 4)]  # duplicates
    edge = [0, RPS - 1, RPS, (NSH - 1) * RPS - 1, (NSH - 1) * RPS, num_rows - 1]
    k = min(n, len(edge))
    ids[-k:] = edge[-k:]
    return ids


def _resident(t, ids):
    libc = ctypes.CDLL(None)
    vec = ctypes.c_ubyte(0)
    got = []
    for a in ((t._region.base + t._offsets(np.asarray(ids, np.int64))) & ~(PAGE - 1)).tolist():
        assert libc.mincore(ctypes.c_void_p(a), PAGE, ctypes.byref(vec)) == 0
        got.append(bool(vec.value & 1))
    return np.array(got)


def _table(ckpt, **kw):
    skip_unless_available(kw.get("io", "auto"), ckpt)  # skips only what the probe says is missing
    return PLETable.from_checkpoint(ckpt, config=PLEConfig(workers=4, chunk=512, **kw))


needs_numba = pytest.mark.skipif(native.load() is None, reason=f"numba: {native.status()}")


@needs_numba
def test_compiled_helpers_match_numpy():
    nat = native.load()
    rng = np.random.default_rng(3)
    region = rng.integers(0, 256, 1 << 20).astype(np.uint8)
    shard_off = np.array([5, 300_001, 600_003], np.int64)
    rps, rb, num_rows = 1500, 160, 4000
    for ids in (rng.integers(0, num_rows, 48), np.array([0, 1499, 1500, 3999, 3999]), np.array([], np.int64)):
        a, b = np.empty((ids.size, rb), np.uint8), np.zeros((ids.size, rb), np.uint8)
        assert nat.gather(region, shard_off, rps, rb, num_rows, ids, a) == -1
        assert native.gather_py(region, shard_off, rps, rb, num_rows, ids, b) == -1
        assert np.array_equal(a, b)
        c = np.empty_like(a)
        assert nat.gather_warm(region, shard_off, rps, rb, num_rows, ids, c, np.zeros(18, np.int64)) == -1
        assert np.array_equal(c, b)
    for bad in (-1, num_rows, 1 << 62):
        ids = np.array([1, 2, bad, 3])
        out = np.empty((4, rb), np.uint8)
        assert nat.check(ids, num_rows) == native.check_py(ids, num_rows) == 2
        assert nat.gather(region, shard_off, rps, rb, num_rows, ids, out) == 2
        assert native.gather_py(region, shard_off, rps, rb, num_rows, ids, out) == 2
        assert nat.gather_warm(region, shard_off, rps, rb, num_rows, ids, out, np.zeros(18, np.int64)) == 2


@pytest.mark.parametrize("nat", [True, False])
@pytest.mark.parametrize("io", ["auto", "direct", "mmap"])
@pytest.mark.parametrize("n", [1, 48, 300, 5000])
def test_gather_bit_identical_native_and_numpy(ckpt, nat, io, n):
    if nat and native.load() is None:
        pytest.skip("numba unavailable")
    t = _table(ckpt, io=io, native=nat)
    rng = np.random.default_rng(n)
    with t:
        assert (t._nat is not None) == nat
        seen = set()
        for r in range(5):
            if r % 2 == 0:
                t.drop_cache()
            ids = _ids(rng, n, t.num_rows)
            assert np.array_equal(t.gather(ids), reference_rows(ckpt, ids))
            seen.add(t.last_strategy)
            out = np.empty((n, t.row_bytes), np.uint8)
            assert t.gather_into(np.ascontiguousarray(ids, np.int64), out) is out  # warm or cold
            assert np.array_equal(out, reference_rows(ckpt, ids))
            seen.add(t.last_strategy)
        for bad in (t.num_rows, -1):
            ids = np.zeros(n, np.int64)
            ids[-1] = bad
            with pytest.raises(IndexError, match=str(bad)):
                t.gather(ids)
            t.gather(np.zeros(n, np.int64))  # warm again: the compiled warm path checks too
            with pytest.raises(IndexError, match=str(bad)):
                t.gather_into(ids, np.empty((n, t.row_bytes), np.uint8))
    if io == "direct" and n <= 4096:
        assert "direct" in seen


@pytest.mark.parametrize("resident_check", [False, True])
def test_direct_path_and_doorkeeper(ckpt, resident_check):
    """O_DIRECT rows do not enter the page cache; the same pages read again go buffered (and are
    then cached), so hot rows end up warm; cached rows are served without a disk read."""
    t = _table(ckpt, io="direct")
    with t:
        t.direct_resident_check = resident_check
        ids = np.arange(3, t.num_rows, t.num_rows // 40)[:40]
        ids[-1] = t.num_rows - 1  # the last row of the last file (O_DIRECT read at EOF is short)
        ref = reference_rows(ckpt, ids)  # before the drop: it reads through its own mapping
        t.drop_cache()
        if _resident(t, ids).any():
            pytest.skip("this filesystem keeps the pages cached after a drop (tmpfs?)")
        assert np.array_equal(t.gather(ids), ref) and t.last_strategy == "direct"
        assert t._seen_n > 0 and t._warm == 0
        assert not _resident(t, ids).any(), "O_DIRECT reads must not populate the page cache"
        assert np.array_equal(t.gather(ids), ref) and t.last_strategy == "direct"
        assert t._warm == 0  # buffered reads from the disk: still cold
        assert _resident(t, ids).all(), "second touch reads buffered: hot rows become cached"
        assert np.array_equal(t.gather(ids), ref)  # all cached: nothing read from the disk
        assert t._warm >= 1
        assert np.array_equal(t.gather(ids), ref) and t.last_strategy == "take"
        # rows cached by someone else (here: reference_rows) but never seen by the doorkeeper
        other = ids[:-1] + 1
        ref2 = reference_rows(ckpt, other)
        t._warm = 0
        t._seen[:] = 0
        t._seen_n = 0
        assert np.array_equal(t.gather(other), ref2)
        assert (t._seen_n == 0) == resident_check  # mincore: copied; else read O_DIRECT once
        # the doorkeeper is cleared once 1/8 full
        t._seen_n = t._seen.shape[0] // 8
        t.drop_cache()
        assert np.array_equal(t.gather(ids), ref)
        assert t._seen_n == 0 and not t._seen.any()


def test_auto_times_three_cold_paths(ckpt):
    t = _table(ckpt)
    with t:
        if direct_missing(ckpt):
            pytest.skip(direct_missing(ckpt))
        assert t._direct_ok, t.io_note  # the probe says O_DIRECT works: auto must offer it
        assert set(t._ewma[0]) == {"uring", "mmap", "direct"} and set(t._ewma[1]) == {"uring", "mmap"}
        t._ewma[0] = {"uring": 2e-6, "mmap": 3e-6, "direct": 1e-6}
        t._cold_n[0] = 0
        picks = [t._pick(0) for _ in range(64)]
        assert picks.count("direct") == 60 and sorted(picks[15::16]) == ["mmap", "mmap", "uring", "uring"]


def test_config_native_and_direct():
    assert config_from_env({"VLLM_PLE_MMAP_NATIVE": "0"}).native is False
    assert config_from_env({}).native is True
    assert config_from_env({"VLLM_PLE_MMAP_IO": "direct"}).io == "direct"
    with pytest.raises(ValueError, match="VLLM_PLE_MMAP_IO"):
        config_from_env({"VLLM_PLE_MMAP_IO": "odirect"})
