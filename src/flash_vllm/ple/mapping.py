"""The PLE table's libc layer: one reserved virtual region with the checkpoint files' page ranges
mapped into it back to back (`Region`), batched MADV_WILLNEED (`Prefetcher`), and the I/O marks
the gather uses to tell a cold batch from a warm one. ctypes only; no numpy at import."""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os
import resource

PAGE = _mmap.PAGESIZE
_MADV_NORMAL, _MADV_RANDOM, _MADV_WILLNEED = 0, 1, 3
_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED = 0x01, 0x02, 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_SYS_PIDFD_OPEN = 434
_SYS_PROCESS_MADVISE = 440
_IOV_MAX = 1024
_POSIX_FADV_RANDOM = 1

class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
_MAP_FAILED = ctypes.c_void_p(-1).value


def io_mark() -> int:
    """Major faults + blocks read from disk so far, whole process (pool threads fault too; I/O that
    readahead, WILLNEED or io_uring starts on our behalf is accounted to us). A change means a
    gather touched the disk: it was cold."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_majflt + r.ru_inblock


def thread_io_mark() -> int:
    """The same for this thread only (cheaper; enough for a copy that runs in this thread)."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_majflt + r.ru_inblock


def _oserr(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


class Region:
    """One reserved virtual range; file page ranges are mapped into it back to back."""

    def __init__(self, pieces: list[tuple[str, int, int]]):
        # pieces: (path, file_lo, file_hi), page-aligned lo, hi rounded up to pages
        self.total = sum(hi - lo for _, lo, hi in pieces)
        base = _libc.mmap(None, self.total, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            raise _oserr(f"reserving {self.total} bytes of address space")
        self.base = base
        self.starts: dict[str, int] = {}  # path -> region offset of file_lo
        self.file_lo: dict[str, int] = {}
        pos = 0
        try:
            for path, lo, hi in pieces:
                fd = os.open(path, os.O_RDONLY)
                try:
                    r = _libc.mmap(base + pos, hi - lo, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, lo)
                finally:
                    os.close(fd)  # the mapping keeps the file
                if r in (None, _MAP_FAILED) or r != base + pos:
                    raise _oserr(f"mapping {path}")
                self.starts[path] = pos
                self.file_lo[path] = lo
                pos += hi - lo
        except Exception:
            self.close()
            raise

    def madvise(self, off: int, length: int, advice: int) -> None:
        if _libc.madvise(self.base + off, length, advice) != 0:
            raise _oserr("madvise")

    def close(self) -> None:
        if getattr(self, "base", None):
            _libc.munmap(self.base, self.total)
            self.base = None


class Prefetcher:
    """Batched MADV_WILLNEED: process_madvise (one call per 1024 ranges), else madvise per range."""

    def __init__(self):
        self.pidfd = -1
        self.mode = "madvise"
        try:
            fd = _libc.syscall(ctypes.c_long(_SYS_PIDFD_OPEN), ctypes.c_long(os.getpid()), ctypes.c_long(0))
            if fd >= 0:
                self.pidfd = int(fd)
                self.mode = "process_madvise"
        except Exception:
            pass
        self.calls = 0

    def willneed(self, addrs, lengths) -> None:
        n = len(addrs)
        if n == 0:
            return
        if self.mode == "process_madvise":
            import numpy as np

            iov = np.empty((n, 2), dtype=np.uint64)
            iov[:, 0] = addrs
            iov[:, 1] = lengths
            for a in range(0, n, _IOV_MAX):
                k = min(_IOV_MAX, n - a)
                r = _libc.syscall(ctypes.c_long(_SYS_PROCESS_MADVISE), ctypes.c_long(self.pidfd),
                                  ctypes.c_void_p(iov.ctypes.data + a * 16), ctypes.c_long(k),
                                  ctypes.c_long(_MADV_WILLNEED), ctypes.c_long(0))
                self.calls += 1
                if r < 0:  # EINVAL (old kernel without WILLNEED), EPERM (seccomp), ENOSYS
                    self.mode = "madvise"
                    self.willneed(addrs[a:], lengths[a:])
                    return
            return
        for a, ln in zip(addrs.tolist(), lengths.tolist()):
            _libc.madvise(ctypes.c_void_p(a), ln, _MADV_WILLNEED)
            self.calls += 1

    def close(self):
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
