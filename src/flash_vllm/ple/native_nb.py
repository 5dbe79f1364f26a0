"""numba versions of the loops in ``native.py`` (imported only through ``native.load()``).

Module-level functions (not closures) so that numba can cache them on disk: ``cache=True`` where
a cache location is writable (next to this file or ``NUMBA_CACHE_DIR``), else compiled per process.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .consts import PAGE, SCRATCH


def _jit_options() -> dict:
    try:
        numba.njit(cache=True)(lambda: 0)  # raises here when no cache location is writable
        return {"nogil": True, "cache": True}
    except Exception:  # noqa: BLE001
        return {"nogil": True, "cache": False}


_opts = _jit_options()


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


@numba.njit(**_opts)
def check(ids, num_rows):
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= num_rows:
            return i
    return -1


@numba.njit(**_opts)
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


@numba.njit(**_opts)
def gather_warm(region, shard_off, rps, rb, num_rows, ids, out, ru):
    """``gather`` plus this thread's major faults + blocks read around the copy (``ru``: int64[18]
    scratch for ``struct rusage``): -2 means the copy went to the disk (the rows were not warm)."""
    c_getrusage(1, ru.ctypes.data)  # RUSAGE_THREAD
    before = ru[9] + ru[11]  # after two timevals: ru_majflt = long 5, ru_inblock = long 7
    bad = gather(region, shard_off, rps, rb, num_rows, ids, out)  # range check first, then the copy
    if bad >= 0:
        return bad
    c_getrusage(1, ru.ctypes.data)
    return -2 if ru[9] + ru[11] != before else -1


@numba.njit(**_opts)
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


@numba.njit(**_opts)
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
