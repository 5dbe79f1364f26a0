"""
Layout. Each file that holds table shards is mapped read-only (only the page range covering its
shards) into ONE reserved virtual region, so every row of every shard has one byte offset into one
numpy array. That array is viewed as overlapping ``V{row_bytes}`` items (stride 1 byte), and a
gather of any rows from any shards is one ``np.take`` call: no per-shard loop, no Python per row,
and ``out=`` can be the pinned staging buffer.

The table splits along its seams: `mapping.py` (the libc region and prefetcher), `discovery.py`
(finding the shards), `strategies.py` (the four gather strategies and the timed picker); this
module builds the table's state and owns its lifecycle and public gather API.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

from .discovery import ROW_BYTES, SUPPORTED_DTYPES, PLETableError, ShardSpec, find_table
from .mapping import _MADV_NORMAL, _MADV_RANDOM, _POSIX_FADV_RANDOM, PAGE, Prefetcher, Region, thread_io_mark
from .strategies import GatherStrategies, TimedPicker

__all__ = ["PAGE", "PLETable", "PLETableError", "ShardSpec", "SUPPORTED_DTYPES", "find_table"]


class PLETable(GatherStrategies, TimedPicker):
    """Read-only view of the PLE table: ``num_rows`` x ``row_bytes`` over mapped shards."""

    def __init__(self, shards: list[ShardSpec], dtype: str, width: int, scale: float | None = None,
                 config=None, stats=None, expected_rows: int | None = None, prefix: str = "", buffers=None):
        import numpy as np

        from .config import PLEConfig

        self._np = np
        self.config = config or PLEConfig()
        self.stats = stats
        self.prefix = prefix
        self.buffers = buffers or {}
        if dtype not in ROW_BYTES:
            raise PLETableError(f"table dtype {dtype} is not one of {', '.join(ROW_BYTES)}")
        if not shards:
            raise PLETableError("no shards")
        self.dtype, self.head_dim, self.scale = dtype, int(width), scale
        self.row_bytes = self.head_dim * ROW_BYTES[dtype]
        shards = sorted(shards, key=lambda s: s.index)
        rps = shards[0].rows
        for i, s in enumerate(shards):
            if s.index != i:
                raise PLETableError(f"shard indices must be 0..{len(shards) - 1}, got {s.index} at position {i}")
            last = i == len(shards) - 1
            if (s.rows != rps and not last) or s.rows > rps or s.rows <= 0:
                raise PLETableError(
                    f"{s.path}: shard {i} has {s.rows} rows; every shard but the last must have {rps} "
                    f"and the last 1..{rps}"
                )
        self.rows_per_shard = rps
        self.num_shards = len(shards)
        self.num_rows = rps * (len(shards) - 1) + shards[-1].rows
        if expected_rows is not None and expected_rows != self.num_rows:
            raise PLETableError(f"table has {self.num_rows} rows, the config implies {expected_rows}")
        self.shards = shards
        # Map the page range of each file that covers its shards.
        spans: dict[str, list[int]] = {}
        for s in shards:
            lo, hi = s.begin, s.begin + s.rows * self.row_bytes
            if hi > os.path.getsize(s.path):
                raise PLETableError(f"{s.path}: shard {s.index} ends at byte {hi}, past the end of the file")
            sp = spans.setdefault(s.path, [lo, hi])
            sp[0], sp[1] = min(sp[0], lo), max(sp[1], hi)
        pieces = [(p, lo - lo % PAGE, -(-hi // PAGE) * PAGE) for p, (lo, hi) in spans.items()]
        try:
            self._region = Region(pieces)
        except OSError as e:
            raise PLETableError(f"cannot map the table: {e}") from None
        rb = self.row_bytes
        buf = (ctypes.c_char * self._region.total).from_address(self._region.base)
        self._buf = buf
        self._rows_view = np.ndarray((self._region.total - rb + 1,), dtype=f"V{rb}", buffer=buf, strides=(1,))
        self._shard_off = np.array(
            [self._region.starts[s.path] + s.begin - self._region.file_lo[s.path] for s in shards], dtype=np.int64)
        self._shard_fileoff = np.array([s.begin for s in shards], dtype=np.int64)
        self._fds: dict[str, int] = {}
        for p in spans:
            fd = os.open(p, os.O_RDONLY)
            self._fds[p] = fd
            if self.config.madvise == "random":
                try:
                    os.posix_fadvise(fd, 0, 0, _POSIX_FADV_RANDOM)  # read(): no readahead around a row
                except OSError:
                    pass
        self._shard_fd = np.array([self._fds[s.path] for s in shards], dtype=np.int32)
        self._region_u8 = np.ndarray((self._region.total,), dtype=np.uint8, buffer=buf)
        self._ru = np.zeros(18, dtype=np.int64)  # struct rusage scratch for the compiled warm path
        self._nat = None
        if self.config.native:
            from . import native

            self._nat = native.load()
        advice = _MADV_RANDOM if self.config.madvise == "random" else _MADV_NORMAL
        self.madvise_ok = True
        for p, lo, hi in pieces:
            try:
                self._region.madvise(self._region.starts[p], hi - lo, advice)
            except OSError:
                self.madvise_ok = False
        self._prefetcher = Prefetcher()
        self._lock = threading.Lock()
        self._pool = None
        self._ring = None
        self.io_note = ""
        self.io = self.config.io
        if self.io in ("auto", "uring", "direct"):
            try:
                from .uring import Ring

                self._ring = Ring(self.config.ring_depth)
                self.io = "uring"
            except (OSError, ImportError) as e:
                if self.config.io in ("uring", "direct"):
                    self.close()
                    raise PLETableError(f"VLLM_PLE_MMAP_IO={self.config.io} but io_uring is unavailable: {e}") from None
                # Docker's default seccomp profile blocks io_uring (moby#46762); process_madvise is allowed.
                self.io = "mmap"
                self.io_note = f"io_uring unavailable ({e})"
        self._dfds: dict[str, int] = {}
        self._direct_ok = False
        if self._ring is not None and self.config.io in ("auto", "direct"):
            self._open_direct(spans)
        if self.config.io == "direct" and not self._direct_ok:
            note = self.io_note
            self.close()
            raise PLETableError(f"VLLM_PLE_MMAP_IO=direct but O_DIRECT reads are unavailable: {note}")
        self._warm = 0  # consecutive fully-cached batches
        self._ewma = [{"uring": None, "mmap": None}, {"uring": None, "mmap": None}]
        if self._direct_ok:
            self._ewma[0]["direct"] = None
        self._cold_n = [0, 0]
        self.last_strategy = ""
        if self.config.prewarm:
            self.prewarm()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, model_dir, layer: int | None = None, config=None, stats=None,
                        expected_rows: int | None = None) -> "PLETable":
        """Open the table of ``model_dir`` (any file layout; resolved through the index)."""
        prefix, shards, dtype, width, scale, buffers = find_table(os.fspath(model_dir), layer)
        return cls(shards, dtype, width, scale, config=config, stats=stats, expected_rows=expected_rows,
                   prefix=prefix, buffers=buffers)

    def describe(self) -> str:
        gib = self.num_rows * self.row_bytes / 2**30
        return (f"PLE mmap: {self.num_shards} shards, {self.num_rows} rows x {self.row_bytes} B "
                f"({gib:.2f} GiB on disk), dtype {self.dtype}, scale {self.scale}, io {self.io}, "
                f"madvise {self.config.madvise}{'' if self.madvise_ok else ' (failed)'}, "
                f"prefetch {self._prefetcher.mode}, {self.config.workers} workers, "
                f"direct {'on' if self._direct_ok else 'off'}, loops {'numba' if self._nat else 'numpy'}"
                + (f"; {self.io_note}" if self.io_note else ""))

    # -- addressing ----------------------------------------------------------------------------
    def _check(self, flat):
        if flat.size == 0:
            return
        if self._nat is not None:
            i = self._nat.check(flat, self.num_rows)
            if i >= 0:
                raise IndexError(f"PLE row id {int(flat[i])} out of range [0, {self.num_rows})")
            return
        # One reduction: as uint64 a negative id is huge, so max() catches both ends.
        if int(flat.view(self._np.uint64).max()) >= self.num_rows:
            lo, hi = int(flat.min()), int(flat.max())
            bad = lo if lo < 0 else hi
            raise IndexError(f"PLE row id {bad} out of range [0, {self.num_rows})")

    def _offsets(self, flat):
        """region byte offset of each row."""
        np = self._np
        s, local = np.divmod(flat, self.rows_per_shard)
        return self._shard_off[s] + local * self.row_bytes

    @staticmethod
    def _flat(ids):
        import numpy as np

        a = np.asarray(ids)
        if a.dtype.kind not in "iu":
            raise TypeError(f"PLE row ids must be integers, got {a.dtype}")
        return np.ascontiguousarray(a.reshape(-1), dtype=np.int64)

    # -- public --------------------------------------------------------------------------------
    def gather(self, ids, out=None):
        """Rows of ``ids`` (any int array, flattened) as uint8 ``(ids.size, row_bytes)``.

        Deduplicates big batches (reads each distinct row once, expands on the CPU). ``out`` may be
        a preallocated C-contiguous uint8 array of that shape (e.g. a pinned buffer's numpy view).
        """
        np = self._np
        t0 = time.perf_counter()
        flat = self._flat(ids)
        n = flat.shape[0]
        if out is None:
            out = np.empty((n, self.row_bytes), dtype=np.uint8)
        elif out.shape != (n, self.row_bytes) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous uint8 {(n, self.row_bytes)}, got {out.dtype} {out.shape}")
        if n <= 4096:
            return self.gather_into(flat, out, t0)  # range-checked there
        self._check(flat)
        dedup_s = 0.0
        if not (self.config.fast_rows and n <= self.config.fast_rows):
            td = time.perf_counter()
            uniq, inv = np.unique(flat, return_inverse=True)
            dedup_s = time.perf_counter() - td
            if uniq.shape[0] < n:
                rows = np.empty((uniq.shape[0], self.row_bytes), dtype=np.uint8)
                self.last_strategy = self._gather_into(uniq, rows)
                np.take(rows, inv, axis=0, out=out)
                self._record(t0, dedup_s, uniq.shape[0])
                return out
        self.last_strategy = self._gather_into(flat, out)
        self._record(t0, dedup_s, n)
        return out

    def gather_into(self, flat, out, t0=None):
        """Decode-sized fast entry: ``flat`` C-contiguous int64 (n,), ``out`` C-contiguous uint8
        (n, row_bytes), e.g. a pinned slot. No conversion, no allocation on the warm path."""
        if t0 is None:
            t0 = time.perf_counter()
        n = flat.shape[0]
        if self._warm and not self.config.fast_rows:
            # Warm: range check, copy and this thread's fault count in one call; a disk read on
            # the way (a major fault: that row waited alone) switches back to the cold paths.
            if self._nat is not None:
                r = self._nat.gather_warm(self._region_u8, self._shard_off, self.rows_per_shard, self.row_bytes,
                                          self.num_rows, flat, out, self._ru)
            else:
                self._check(flat)
                f0 = thread_io_mark()
                self._take(flat, out)
                r = -2 if thread_io_mark() != f0 else -1
            if r >= 0:
                self._check(flat)  # raises, naming the id
            if r == -2:
                self._warm = 0
            self.last_strategy = "take"
        else:
            self._check(flat)
            self.last_strategy = self._gather_into(flat, out)
        if self.stats is not None:
            self._record(t0, 0.0, n)
        return out

    def gather_unique(self, ids, out=None):
        """``(rows of np.unique(ids), inverse)`` — what the stager uploads and expands on the GPU."""
        np = self._np
        t0 = time.perf_counter()
        flat = self._flat(ids)
        self._check(flat)
        uniq, inv = np.unique(flat, return_inverse=True)
        dedup_s = time.perf_counter() - t0
        k = uniq.shape[0]
        if out is None:
            out = np.empty((k, self.row_bytes), dtype=np.uint8)
        else:
            out = out[:k]
        self.last_strategy = self._gather_into(uniq, out)
        self._record(t0, dedup_s, k)
        return out, inv.reshape(-1)

    def _record(self, t0, dedup_s, rows):
        if self.stats is not None:
            self.stats.record(gather_s=time.perf_counter() - t0 - dedup_s, dedup_s=dedup_s, rows=rows,
                              bytes=rows * self.row_bytes)

    def prefetch(self, ids) -> None:
        """Hint only: start reading the pages of ``ids`` (MADV_WILLNEED); returns at once."""
        flat = self._flat(ids)
        self._check(flat)
        self._willneed(flat)

    def prewarm(self, block: int = 64 << 20) -> None:
        """Read every shard once sequentially (fills the page cache; unaffected by MADV_RANDOM)."""
        for s in self.shards:
            fd = self._fds[s.path]
            pos, end = s.begin, s.begin + s.rows * self.row_bytes
            while pos < end:
                k = min(block, end - pos)
                try:
                    os.posix_fadvise(fd, pos, k, os.POSIX_FADV_WILLNEED)
                    os.pread(fd, 1, pos + k - 1)
                except OSError:
                    pass
                pos += k

    def drop_cache(self) -> None:
        """Ask the kernel to drop the table's clean pages from the page cache (benchmarks, tests)."""
        # Pages we still map are not dropped: unmap our page-table entries first (MADV_DONTNEED on
        # a read-only shared mapping only unmaps), then drop the clean pages.
        self._region.madvise(0, self._region.total, 4)
        for s in self.shards:
            try:
                # whole pages only are dropped: round out (the header's page goes too; harmless)
                lo = s.begin - s.begin % PAGE
                os.posix_fadvise(self._fds[s.path], lo, s.begin + s.rows * self.row_bytes - lo + PAGE - 1,
                                 os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        self._warm = 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if getattr(self, "_ring", None) is not None:
            self._ring.close()
            self._ring = None
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.close()
        for fd in list(getattr(self, "_fds", {}).values()) + list(getattr(self, "_dfds", {}).values()):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}
        self._dfds = {}
        self.__dict__.pop("_scratch", None)
        if getattr(self, "_scratch_map", None) is not None:
            self._scratch_map.close()
            self._scratch_map = None
        self.__dict__.pop("_region_u8", None)
        self.__dict__.pop("_rows_view", None)
        self.__dict__.pop("_buf", None)
        if getattr(self, "_region", None) is not None:
            self._region.close()
            self._region = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
