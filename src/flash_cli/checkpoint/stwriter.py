"""Streaming safetensors writer: header first, then each tensor's bytes in order.

safetensors' own `save_file` needs every tensor in memory at once; a 10.7 GB shard must be
written tensor by tensor. The header is the same format the Rust writer emits (JSON, padded
with spaces to a multiple of 8, contiguous data offsets), and `flash_common.stheader` plus
`safetensors.safe_open` read it back in the tests.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

COPY_CHUNK = 64 * 1024 * 1024
# Write-behind: start writeback of every range as soon as it is written, and once more than this
# many bytes are in flight, wait for the oldest ranges and drop them from the page cache.
BEHIND_BYTES = 256 * 1024 * 1024
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
_sync_file_range = []


def _sfr():
    """libc sync_file_range (Linux) or None; looked up once."""
    if not _sync_file_range:
        fn = None
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _sync_file_range.append(fn)
    return _sync_file_range[0]


class WriteBehind:
    """Streaming-write hygiene for one output file (Linux; a no-op elsewhere).

    Plain buffered writes let dirty pages pile up to the kernel's dirty limit, then throttle the
    writer in bursts while the disk idles between them, and leave gigabytes of cache that other
    work must reclaim. Here every written range is handed to the disk at once
    (sync_file_range WRITE, asynchronous) and, once BEHIND_BYTES are in flight, the oldest are
    waited for and dropped (POSIX_FADV_DONTNEED only drops whole clean pages, so a page shared
    with a neighbour not yet written stays). Durability still comes from fsync at the end:
    sync_file_range writes no metadata and flushes no disk cache.
    """

    def __init__(self, fd: int, behind: int | None = None):
        self.fd = fd
        self.behind = BEHIND_BYTES if behind is None else behind
        self.fn = _sfr() if hasattr(os, "posix_fadvise") else None
        self.pending: deque = deque()
        self.pending_bytes = 0
        self.lock = threading.Lock()

    def wrote(self, offset: int, n: int) -> None:
        if self.fn is None or n <= 0:
            return
        self.fn(self.fd, offset, n, _SFR_WRITE)
        old = []
        with self.lock:
            self.pending.append((offset, n))
            self.pending_bytes += n
            while self.pending_bytes > self.behind:
                o, ln = self.pending.popleft()
                self.pending_bytes -= ln
                old.append((o, ln))
        for o, ln in old:
            self.fn(self.fd, o, ln, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
            os.posix_fadvise(self.fd, o, ln, os.POSIX_FADV_DONTNEED)


def drop_cache(fd: int, offset: int, n: int) -> None:
    """Forget clean pages of a source range read once (keeps 16 GB of passing reads from
    pushing everything else out of the page cache)."""
    if hasattr(os, "posix_fadvise") and n > 0:
        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)


def copy_chunks(src_fd: int, dst_fd: int, src_offset: int, length: int, dst_offset: int | None = None,
                on_write: Callable[[int], None] | None = None, what: str = ""):
    """Copy [src_offset, +length) of `src_fd` into `dst_fd`, at `dst_offset` (positional) or at the
    file position (None), in COPY_CHUNK pieces: copy_file_range where the kernel does it, else
    pread + (p)write with every short write finished (signals, quotas). Yields (src offset, dst
    offset or None, bytes) after each piece."""
    end = src_offset + length
    while src_offset < end:
        n = min(COPY_CHUNK, end - src_offset)
        if on_write:
            on_write(n)
        try:
            done = os.copy_file_range(src_fd, dst_fd, n, src_offset, dst_offset)
        except OSError:
            done = 0
        if done <= 0:  # not supported here (or a hole the kernel refuses): plain read/write
            chunk = os.pread(src_fd, n, src_offset)
            if len(chunk) != n:
                raise OSError(f"short read at {src_offset} in the source of {what}")
            view, at = memoryview(chunk), dst_offset
            while view:
                w = os.write(dst_fd, view) if at is None else os.pwrite(dst_fd, view, at)
                view = view[w:]
                at = None if at is None else at + w
            done = n
        yield src_offset, dst_offset, done
        src_offset += done
        dst_offset = None if dst_offset is None else dst_offset + done


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def header_bytes(entries: Iterable[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + JSON header for tensors laid out back to back in this order."""
    obj: dict[str, object] = {}
    if metadata:
        obj["__metadata__"] = dict(metadata)
    pos = 0
    for e in entries:
        obj[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def file_size(entries: list[Entry], metadata: dict[str, str] | None = None) -> int:
    return len(header_bytes(entries, metadata)) + sum(e.nbytes for e in entries)


class Writer:
    """Write one file: `write_bytes` for computed tensors, `copy_range` for untouched ones.

    Checks that what was written matches the header exactly (a short tensor is a bug, not
    a truncated file on disk), fsyncs on close. `on_write` is a test hook (fault injection).
    """

    def __init__(self, path: str | os.PathLike, entries: list[Entry], metadata: dict[str, str] | None = None,
                 on_write: Callable[[int], None] | None = None):
        self.path = os.fspath(path)
        self.entries = entries
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.on_write = on_write
        self.i = 0
        self.left = 0
        self._raw_write(header_bytes(entries, metadata))
        self._next()

    def _next(self) -> None:
        while self.i < len(self.entries) and self.entries[self.i].nbytes == 0:
            self.i += 1
        self.left = self.entries[self.i].nbytes if self.i < len(self.entries) else 0

    def _account(self, n: int) -> None:
        if n > self.left:
            raise RuntimeError(f"{self.path}: {n} bytes for {self.current} but only {self.left} left in it")
        self.left -= n
        if self.left == 0:
            self.i += 1
            self._next()

    @property
    def current(self) -> str:
        return self.entries[self.i].name if self.i < len(self.entries) else "<end>"

    def _raw_write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            if self.on_write:
                self.on_write(len(view))
            n = os.write(self.fd, view[:COPY_CHUNK])
            view = view[n:]

    def write_bytes(self, data) -> None:
        size = memoryview(data).nbytes
        self._account(size)
        self._raw_write(data)

    def copy_range(self, src_fd: int, offset: int, length: int) -> None:
        """Copy bytes [offset, offset+length) of another file (kernel copy where it can)."""
        self._account(length)
        for _ in copy_chunks(src_fd, self.fd, offset, length, on_write=self.on_write, what=self.current):
            pass

    def close(self, fsync: bool = True) -> None:
        """fsync=False: the caller syncs later (lets the next file's work overlap this writeback)."""
        try:
            if self.i < len(self.entries):
                raise RuntimeError(f"{self.path}: closed before {self.current} was written")
            if fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class PositionalWriter:
    """Write one file out of order: every tensor's place is known from the header, so workers
    `pwrite` converted data while the main thread copies untouched ranges kernel-side at the
    same time. `close()` checks that every byte of every tensor was written exactly once.
    Written ranges stream to the disk as they come (WriteBehind)."""

    def __init__(self, path: str | os.PathLike, entries: list[Entry], metadata: dict[str, str] | None = None,
                 on_write: Callable[[int], None] | None = None):
        self.path = os.fspath(path)
        head = header_bytes(entries, metadata)
        self.offsets: dict[str, int] = {}
        pos = len(head)
        for e in entries:
            self.offsets[e.name] = pos
            pos += e.nbytes
        self.size = pos
        self.sizes = {e.name: e.nbytes for e in entries}
        self.done: dict[str, int] = {e.name: 0 for e in entries}
        self.on_write = on_write
        self._lock = threading.Lock()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.behind = WriteBehind(self.fd)
        self._pwrite(head, 0)

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            chunk = view[:COPY_CHUNK]
            if self.on_write:
                self.on_write(len(chunk))
            n = os.pwrite(self.fd, chunk, offset)
            self.behind.wrote(offset, n)
            view, offset = view[n:], offset + n

    def _account(self, name: str, start: int, n: int) -> int:
        if start < 0 or start + n > self.sizes[name]:
            raise RuntimeError(f"{self.path}: bytes [{start}, {start + n}) are outside {name} ({self.sizes[name]} B)")
        with self._lock:
            self.done[name] += n
        return self.offsets[name] + start

    def write_at(self, name: str, start: int, data) -> None:
        """`data` goes to byte `start` of tensor `name` (thread-safe)."""
        self._pwrite(data, self._account(name, start, memoryview(data).nbytes))

    def copy_into(self, name: str, src_fd: int, src_offset: int) -> None:
        """The whole tensor `name` from [src_offset, +size) of another file, kernel-side where possible."""
        length = self.sizes[name]
        dst = self._account(name, 0, length)
        for src_at, dst_at, n in copy_chunks(src_fd, self.fd, src_offset, length, dst, self.on_write, name):
            drop_cache(src_fd, src_at, n)
            self.behind.wrote(dst_at, n)

    def close(self, fsync: bool = True) -> None:
        try:
            short = [n for n, d in self.done.items() if d != self.sizes[n]]
            if short:
                raise RuntimeError(f"{self.path}: {short[0]} got {self.done[short[0]]} of {self.sizes[short[0]]} bytes")
            os.ftruncate(self.fd, self.size)
            if fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass

