"""Minimal io_uring through ctypes + numpy: batches of plain reads, submitted together.

Why: a decode step needs ~48 random 160-byte rows. Faulting them through the mmap costs one
serial page fault each; a ring submits every read at once, the kernel's async buffered reads keep
them all in flight (queue depth = batch), and each row is copied straight into the destination
(the pinned staging buffer), so nothing is mapped and nothing faults. The same ring with an
O_DIRECT fd measures the disk's own random-read bound (lab/bench_ple.py).

No liburing needed: io_uring_setup/enter are syscalls 425/426 on every architecture (the unified
syscall table), rings are mmapped with Python's mmap and viewed as numpy arrays, and SQEs are
filled for a whole batch with one vectorized assignment. Submission without SQPOLL goes through
io_uring_enter, which orders our ring writes for the kernel on this CPU; completions are read
after io_uring_enter returned with them, so no extra barriers are needed.

``Ring(depth)`` raises ``OSError`` when io_uring is unavailable (old kernel, seccomp in a
container, ``kernel.io_uring_disabled``); callers fall back to madvise + mmap.
A Ring is not thread-safe: one per thread, or a lock around it.
"""

from __future__ import annotations

import ctypes
import mmap
import os

_SYS_IO_URING_SETUP = 425
_SYS_IO_URING_ENTER = 426
_OFF_SQ_RING = 0
_OFF_CQ_RING = 0x8000000
_OFF_SQES = 0x10000000
_ENTER_GETEVENTS = 1
OP_READ = 22


class _SqOff(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in
                ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped", "array", "resv1")] + [
        ("user_addr", ctypes.c_uint64)]


class _CqOff(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in
                ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes", "flags", "resv1")] + [
        ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in
                ("sq_entries", "cq_entries", "flags", "sq_thread_cpu", "sq_thread_idle", "features", "wq_fd")] + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOff), ("cq_off", _CqOff)]


_libc = None


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


class Ring:
    """One io_uring of ``depth`` SQ entries (a power of two is used by the kernel)."""

    def __init__(self, depth: int = 256):
        import numpy as np

        self._np = np
        p = _Params()
        sc = _syscall()
        fd = sc(ctypes.c_long(_SYS_IO_URING_SETUP), ctypes.c_long(depth), ctypes.byref(p))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = int(fd)
        self._maps: list[mmap.mmap] = []
        try:
            sq_size = p.sq_off.array + p.sq_entries * 4
            cq_size = p.cq_off.cqes + p.cq_entries * 16
            sq = self._map(sq_size, _OFF_SQ_RING)
            cq = self._map(cq_size, _OFF_CQ_RING)
            sqes = self._map(p.sq_entries * 64, _OFF_SQES)
        except Exception:
            self.close()
            raise
        u32 = np.uint32
        self.sq_entries = p.sq_entries
        self.cq_entries = p.cq_entries
        self._sq_tail = np.frombuffer(sq, u32, 1, p.sq_off.tail)
        self._sq_mask = int(np.frombuffer(sq, u32, 1, p.sq_off.ring_mask)[0])
        arr = np.frombuffer(sq, u32, p.sq_entries, p.sq_off.array)
        arr[:] = np.arange(p.sq_entries, dtype=u32)  # SQ index i -> SQE i, fixed forever
        self._cq_head = np.frombuffer(cq, u32, 1, p.cq_off.head)
        self._cq_tail = np.frombuffer(cq, u32, 1, p.cq_off.tail)
        self._cq_mask = int(np.frombuffer(cq, u32, 1, p.cq_off.ring_mask)[0])
        cqe_t = np.dtype({"names": ["user_data", "res"], "formats": ["<u8", "<i4"], "offsets": [0, 8], "itemsize": 16})
        self._cqes = np.frombuffer(cq, cqe_t, p.cq_entries, p.cq_off.cqes)
        sqe_t = np.dtype({
            "names": ["opcode", "flags", "ioprio", "fd", "off", "addr", "len", "rw_flags", "user_data"],
            "formats": ["u1", "u1", "<u2", "<i4", "<u8", "<u8", "<u4", "<u4", "<u8"],
            "offsets": [0, 1, 2, 4, 8, 16, 24, 28, 32], "itemsize": 64})
        raw = np.frombuffer(sqes, np.uint8)
        raw[:] = 0
        self._sqes = np.frombuffer(sqes, sqe_t)
        self._sqes["opcode"] = OP_READ
        self._enter = sc
        self.submitted_total = 0
        self.last_inline = 0

    def _map(self, size: int, off: int) -> mmap.mmap:
        m = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=off)
        self._maps.append(m)
        return m

    def _sys_enter(self, to_submit: int, min_complete: int) -> int:
        while True:
            r = self._enter(ctypes.c_long(_SYS_IO_URING_ENTER), ctypes.c_long(self.fd), ctypes.c_long(to_submit),
                            ctypes.c_long(min_complete), ctypes.c_long(_ENTER_GETEVENTS if min_complete else 0),
                            ctypes.c_void_p(0), ctypes.c_long(0))
            if r >= 0:
                return int(r)
            err = ctypes.get_errno()
            if err in (4, 11):  # EINTR, EAGAIN: retry
                continue
            raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    def read_batch(self, fds, offsets, addrs, lengths, depth: int | None = None):
        """Read ``lengths[i]`` bytes at ``offsets[i]`` of ``fds[i]`` into memory at ``addrs[i]``.

        Arrays are int64 (``fds`` may be a scalar). Keeps up to ``depth`` reads in flight (default:
        the SQ size). Returns the int64 array of results (bytes read or -errno) in input order.
        """
        np = self._np
        n = int(offsets.shape[0])
        res = np.empty(n, dtype=np.int64)
        if n == 0:
            return res
        depth = min(depth or self.sq_entries, self.sq_entries, self.cq_entries)
        fds = np.broadcast_to(np.asarray(fds, dtype=np.int32), (n,))
        sqes = self._sqes
        mask = self._sq_mask
        nxt = 0
        done = 0
        inflight = 0
        inline = 0  # completions that were ready when the submitting call returned
        tail = int(self._sq_tail[0])
        while done < n:
            k = min(depth - inflight, n - nxt)
            if k > 0:
                idx = (tail + np.arange(k, dtype=np.int64)) & mask
                sl = slice(nxt, nxt + k)
                sqes["fd"][idx] = fds[sl]
                sqes["off"][idx] = offsets[sl]
                sqes["addr"][idx] = addrs[sl]
                sqes["len"][idx] = lengths[sl]
                sqes["user_data"][idx] = np.arange(nxt, nxt + k, dtype=np.uint64)
                tail = (tail + k) & 0xFFFFFFFF
                self._sq_tail[0] = tail
                nxt += k
                inflight += k
                self._sys_enter(k, 0)  # submit; cached pages complete inside this call
                got = self._reap(res)
                inline += got
            else:
                # Wait for all when nothing is left to submit; otherwise refill at half depth.
                want = inflight if nxt == n else max(1, inflight - depth // 2)
                self._sys_enter(0, want)
                got = self._reap(res)
            done += got
            inflight -= got
        self.last_inline = inline
        self.submitted_total += n
        return res

    def _reap(self, res) -> int:
        np = self._np
        head = int(self._cq_head[0])
        ctail = int(self._cq_tail[0])
        cnt = (ctail - head) & 0xFFFFFFFF
        if cnt:
            ci = (head + np.arange(cnt, dtype=np.int64)) & self._cq_mask
            c = self._cqes[ci]
            res[c["user_data"].astype(np.int64)] = c["res"]
            self._cq_head[0] = ctail
        return cnt

    def close(self) -> None:
        for a in ("_sq_tail", "_cq_head", "_cq_tail", "_cqes", "_sqes"):
            self.__dict__.pop(a, None)  # drop the numpy views so the mmaps can close
        for m in getattr(self, "_maps", []):
            try:
                m.close()
            except BufferError:
                pass  # numpy views still alive; the mapping goes when they do
        self._maps = []
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
