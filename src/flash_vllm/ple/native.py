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

PAGE = 4096
SCRATCH = 2 * PAGE  # O_DIRECT scratch per row: a row spans at most two 4 KiB pages (rows <= 4 KiB)

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
    """numba versions of the helpers above (lazily compiled; cached on disk where writable)."""
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def memcpy(typingctx, dst, src, n):
        """LLVM memcpy between two addresses: a byte loop over arrays that may alias is not
        vectorized (8 µs for 48 rows), a memcpy call is (~1 µs)."""
        sig = types.void(types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            d, s, k = args
            i8p = ir.IntType(8).as_pointer()
            cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), k, 1)
            return context.get_dummy_value()

        return sig, codegen

    # libc calls by symbol (libc is in the process): unlike a ctypes pointer, an intrinsic lets
    # numba cache the compiled function on disk.
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)

    @intrinsic
    def c_getrusage(typingctx, who, buf):
        def codegen(context, builder, signature, a):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32, i8p]), "getrusage")
            return builder.call(fn, [builder.trunc(a[0], i32), builder.inttoptr(a[1], i8p)])

        return types.int32(types.intp, types.intp), codegen

    @intrinsic
    def c_mincore(typingctx, addr, length, vec):
        def codegen(context, builder, signature, a):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i8p, ir.IntType(64), i8p]),
                                                "mincore")
            return builder.call(fn, [builder.inttoptr(a[0], i8p), a[1], builder.inttoptr(a[2], i8p)])

        return types.int32(types.intp, types.intp, types.intp), codegen

    def jit(fn, cache=True):
        try:
            return numba.njit(nogil=True, cache=cache)(fn)
        except Exception:  # no writable cache location (read-only site-packages and $HOME)
            return numba.njit(nogil=True, cache=False)(fn)

    def check(ids, num_rows):
        for i in range(ids.shape[0]):
            if ids[i] < 0 or ids[i] >= num_rows:
                return i
        return -1

    def gather(region, shard_off, rps, rb, num_rows, ids, out):
        n = ids.shape[0]
        for i in range(n):
            if ids[i] < 0 or ids[i] >= num_rows:
                return i
        src = region.ctypes.data
        dst = out.ctypes.data
        for i in range(n):
            r = ids[i]
            s = r // rps
            memcpy(dst + i * rb, src + shard_off[s] + (r - s * rps) * rb, rb)
        return -1

    def gather_warm(region, shard_off, rps, rb, num_rows, ids, out, ru):
        """``gather`` plus this thread's major faults + blocks read around the copy (``ru``: int64[18]
        scratch for ``struct rusage``): -2 means the copy went to the disk (the rows were not warm)."""
        n = ids.shape[0]
        for i in range(n):
            if ids[i] < 0 or ids[i] >= num_rows:
                return i
        c_getrusage(1, ru.ctypes.data)  # RUSAGE_THREAD
        before = ru[9] + ru[11]  # after two timevals: ru_majflt = long 5, ru_inblock = long 7
        src = region.ctypes.data
        dst = out.ctypes.data
        for i in range(n):
            r = ids[i]
            s = r // rps
            memcpy(dst + i * rb, src + shard_off[s] + (r - s * rps) * rb, rb)
        c_getrusage(1, ru.ctypes.data)
        return -2 if ru[9] + ru[11] != before else -1

    def plan_direct(base, shard_off, shard_fileoff, shard_fd, shard_dfd, rps, rb, ids, out, region, seen,
                    out_addr, scratch_addr, vec, p_fd, p_off, p_addr, p_len, p_row, p_skip, resident_check):
        k = 0
        nd = 0
        mask = seen.shape[0] - 1
        vaddr = vec.ctypes.data
        for i in range(ids.shape[0]):
            r = ids[i]
            s = r // rps
            loc = r - s * rps
            moff = shard_off[s] + loc * rb
            foff = shard_fileoff[s] + loc * rb
            p0 = (base + moff) & ~(PAGE - 1)
            p1 = (base + moff + rb - 1) & ~(PAGE - 1)
            npg = (p1 - p0) // PAGE + 1
            if resident_check and c_mincore(p0, npg * PAGE, vaddr) == 0 and (vec[0] & 1) and (vec[npg - 1] & 1):
                memcpy(out_addr + i * rb, base + moff, rb)
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

    def extract_direct(scratch, rb, k, p_row, p_skip, p_len, res, out):
        bad = 0
        for j in range(k):
            i = p_row[j]
            sk = p_skip[j]
            if sk >= 0:
                ok = res[j] >= sk + rb
            else:
                ok = res[j] == rb
            if not ok:
                p_row[bad] = i
                bad += 1
            elif sk >= 0:
                memcpy(out.ctypes.data + i * rb, scratch.ctypes.data + i * SCRATCH + sk, rb)
        return bad

    class NS:
        pass

    ns = NS()
    ns.check = jit(check)
    ns.gather = jit(gather)
    ns.gather_warm = jit(gather_warm)
    ns.plan_direct = jit(plan_direct)
    ns.extract_direct = jit(extract_direct)
    return ns


def load():
    """The compiled helpers (compiled on first call of each), or None when numba is missing."""
    global _native, _native_err
    if _native is None and not _native_err:
        try:
            _native = _compile()
        except ImportError as e:
            _native_err = f"numba unavailable ({e})"
    return _native


def status() -> str:
    return "numba" if _native is not None else (_native_err or "not loaded")
