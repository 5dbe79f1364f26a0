"""Compiled (numba) inner loops of the gather, with numpy fallbacks that give identical results.

Why: a warm 48-row gather is ~8 KB of memcpy, but through numpy it is a dozen small-array calls
(divmod, index arithmetic, fancy index, range check: ~16 µs on a 16-core host). One compiled call
does the range check, the address computation and the copy straight into the pinned slot.
The cold O_DIRECT path (``table._direct``) also needs a per-row loop (``mincore`` per row to find
the rows already in the page cache, then a read plan); compiled, that is one call too.

numba is optional: vLLM's image ships it (vLLM pins ``numba==0.65.0``) and our ``cli`` extra pins it
for the hybrid tools; without it, or with ``VLLM_PLE_MMAP_NATIVE=0`` (``PLEConfig.native``), the
table runs the numpy/ctypes twins below. ``tests/unit/test_ple_native.py`` checks both give the same bytes.
"""

from __future__ import annotations

import ctypes

from .consts import PAGE, SCRATCH

_libc = ctypes.CDLL(None, use_errno=True)
# Pointers typed as size_t: numba calls ctypes functions with integer arguments only (same LP64 ABI).
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
_mincore.restype = ctypes.c_int


# --- pure Python/numpy versions (also the source the compiled ones are built from) -------------

def check_py(ids, num_rows):
    """Index of the first id outside [0, num_rows), or -1."""
    import numpy as np

    if ids.shape[0] == 0:
        return -1
    bad = np.flatnonzero(ids.view(np.uint64) >= num_rows)
    return int(bad[0]) if bad.shape[0] else -1


def gather_py(region, shard_off, rps, rb, num_rows, ids, out):
    """Range-check ``ids`` and copy each row from the mapped ``region`` into ``out``.
    Returns the index of the first bad id (nothing copied) or -1."""
    import numpy as np

    bad = check_py(ids, num_rows)
    if bad >= 0:
        return bad
    s, local = np.divmod(ids, rps)
    off = shard_off[s] + local * rb
    out[...] = region[off[:, None] + np.arange(rb)]
    return -1


def plan_direct_py(base, shard_off, shard_fileoff, shard_fd, shard_dfd, rps, rb, ids, out, region, seen,
                   out_addr, scratch_addr, vec, p_fd, p_off, p_addr, p_len, p_row, p_skip, resident_check):
    """For each row: (with ``resident_check``) in the page cache (``mincore`` on its pages) -> copy
    it from the mapping now; seen before (``seen`` doorkeeper) -> a buffered read of the row into
    ``out`` (served from the page cache if there, else it becomes cached: hot rows stay cached);
    else an O_DIRECT read of its 4 KiB page(s) into the row's ``SCRATCH`` bytes. Fills the plan
    arrays; returns (reads planned, of which direct)."""
    k = 0
    nd = 0
    mask = seen.shape[0] - 1
    vaddr = int(vec.ctypes.data)
    for i in range(ids.shape[0]):
        r = int(ids[i])
        s = r // rps
        loc = r - s * rps
        moff = int(shard_off[s]) + loc * rb
        foff = int(shard_fileoff[s]) + loc * rb
        p0 = (base + moff) & ~(PAGE - 1)
        p1 = (base + moff + rb - 1) & ~(PAGE - 1)
        npg = (p1 - p0) // PAGE + 1
        if resident_check and _mincore(p0, npg * PAGE, vaddr) == 0 and (vec[0] & 1) and (vec[npg - 1] & 1):
            out[i, :] = region[moff:moff + rb]
            continue
        key = (((moff >> 12) * 2654435761) >> 7) & mask
        p_row[k] = i
        if seen[key]:
            p_fd[k] = shard_fd[s]
            p_off[k] = foff
            p_addr[k] = out_addr + i * rb
            p_len[k] = rb
            p_skip[k] = -1
        else:
            seen[key] = 1
            lo = foff & ~(PAGE - 1)
            p_fd[k] = shard_dfd[s]
            p_off[k] = lo
            p_addr[k] = scratch_addr + i * SCRATCH
            p_len[k] = ((foff + rb + PAGE - 1) & ~(PAGE - 1)) - lo
            p_skip[k] = foff - lo
            nd += 1
        k += 1
    return k, nd


def extract_direct_py(scratch, rb, k, p_row, p_skip, p_len, res, out):
    """Copy each O_DIRECT row out of its scratch pages; returns the number of failed reads, whose
    ``p_row`` entries are moved to the front (the caller reads those rows through the mapping)."""
    bad = 0
    for j in range(k):
        i = p_row[j]
        sk = p_skip[j]
        ok = res[j] >= sk + rb if sk >= 0 else res[j] == rb
        if not ok:
            p_row[bad] = i
            bad += 1
        elif sk >= 0:
            a = i * SCRATCH + sk
            out[i, :] = scratch[a:a + rb]
    return bad


# --- compiled versions -------------------------------------------------------------------------

_native = None
_native_err = ""


def _compile():
    """The numba versions (``native_nb.py``), compiled on first call, cached on disk where writable."""
    from . import native_nb  # imports only .consts: no circle

    return native_nb


def _smoke(ns) -> None:
    """Compile every helper for the argument types the table passes (numba compiles per call
    signature) and check it against its numpy twin, so a numba release that cannot build or
    miscompiles them turns into the numpy path at load time, never into a failed lookup."""
    import numpy as np

    region = (np.arange(3 * PAGE, dtype=np.int64) * 7 % 251).astype(np.uint8)
    shard_off = np.array([3, 5000], np.int64)
    ids = np.array([0, 9, 10, 19], np.int64)
    a, b = np.zeros((4, 160), np.uint8), np.ones((4, 160), np.uint8)
    if ns.check(ids, 20) != -1 or ns.check(ids, 19) != 3:
        raise RuntimeError("check")
    if ns.gather(region, shard_off, 10, 160, 20, ids, a) != -1 or gather_py(region, shard_off, 10, 160, 20, ids, b) != -1 \
            or not np.array_equal(a, b):
        raise RuntimeError("gather")
    a[:] = 0
    if ns.gather_warm(region, shard_off, 10, 160, 20, ids, a, np.zeros(18, np.int64)) != -1 or not np.array_equal(a, b):
        raise RuntimeError("gather_warm")
    plan = (np.zeros(4, np.int32), np.zeros(4, np.int64), np.zeros(4, np.int64), np.zeros(4, np.int64),
            np.zeros(4, np.int64), np.zeros(4, np.int64))
    seen = np.zeros(1 << 4, np.uint8)
    k, nd = ns.plan_direct(region.ctypes.data, shard_off, shard_off, np.array([-1, -1], np.int32),
                           np.array([-1, -1], np.int32), 10, 160, ids, a, region, seen, a.ctypes.data,
                           region.ctypes.data, np.zeros(2, np.uint8), *plan, True)
    if not 0 <= nd <= k <= 4:
        raise RuntimeError("plan_direct")
    res = np.zeros(4, np.int64)
    if ns.extract_direct(region, 160, 0, plan[4], plan[5], plan[3], res, a) != 0:
        raise RuntimeError("extract_direct")


def load():
    """The compiled helpers (compiled and checked on first use), or None when numba is missing or
    cannot build them (``status()`` says why)."""
    global _native, _native_err
    if _native is None and not _native_err:
        try:
            ns = _compile()
            _smoke(ns)
            _native = ns
        except ImportError as e:
            _native_err = f"numba unavailable ({e})"
        except Exception as e:  # noqa: BLE001 -- any numba failure means: use the numpy twins
            _native_err = f"numba helpers failed to build ({type(e).__name__}: {str(e)[:200]})"
    return _native


def status() -> str:
    return "numba" if _native is not None else (_native_err or "not loaded")
