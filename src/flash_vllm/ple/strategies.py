"""Strategies (``gather``; results are always bit-identical to ``table[ids]``):

* ``uring`` (default when io_uring works): every row is read with a buffered ``read`` of exactly
  ``row_bytes`` straight into the output, all submitted together (queue depth = batch, capped by
  ``ring_depth``). Cold pages become parallel reads; nothing is mapped or faulted. Used for every
  batch size; big batches are deduplicated first and expanded with the inverse.
* ``take`` (warm fast path): when the last uring batches completed entirely inside the submitting
  syscall (all pages were in the page cache), the next decode batches are plain ``np.take`` on
  the mapping (~µs). A take that runs slow (it faulted) switches back at once.
  ``fast_rows = N > 0`` forces take for batches of <= N rows (upstream's meaning of FAST_ROWS).
* ``direct`` (decode-sized batches, io_uring + O_DIRECT): a row's page read for the first time is
  read with O_DIRECT (its 4 KiB page(s) into a page-aligned scratch buffer, then extracted);
  O_DIRECT skips the page cache's page allocation and insertion (the disk's own bound), but its
  pages never become cached. So a doorkeeper (a hashed bitmap of pages read directly, cleared
  when 1/8 full) sends a page seen before to a buffered read into the output: served from the
  page cache when cached (inside the submitting syscall), else read and cached, so hot (zipfian)
  rows end up warm. ``direct_resident_check`` adds a ``mincore`` per row first (rows in the page
  cache copied from the mapping): exact, but ~1-2 µs of syscall per row, so off by default.
* ``willneed`` (no io_uring: old kernel, seccomp): one ``process_madvise(MADV_WILLNEED)`` call
  per 1024 page ranges (``madvise`` per range as fallback), then ``take``; big batches are split
  over a thread pool of ``workers`` after dedup.

With ``io=auto`` the cold paths available (uring, mmap, direct for decode sizes) are timed on
cold batches and the fastest is kept. The per-row loops (range check, address computation, copy,
the direct path's plan) run compiled through numba when it is importable (``native.py``).

The strategies are methods of `GatherStrategies`, a mixin of `PLETable` (table.py builds the state
they share: the mapping, the fds, the ring, the doorkeeper); `TimedPicker` keeps the per-size-class
timings and picks among them.
"""

from __future__ import annotations

import os
import time

from .mapping import PAGE, io_mark


class GatherStrategies:
    """The gather strategies of `PLETable` (see the module doc)."""

    def _open_direct(self, spans) -> None:
        """O_DIRECT fds + scratch for the ``direct`` path; on failure (tmpfs on old kernels, a
        filesystem without O_DIRECT) the path is simply not offered."""
        import mmap as mm

        np = self._np
        try:
            for p in spans:
                self._dfds[p] = os.open(p, os.O_RDONLY | os.O_DIRECT)
        except (OSError, AttributeError) as e:
            self.io_note = (self.io_note + "; " if self.io_note else "") + f"O_DIRECT unavailable ({e})"
            for fd in self._dfds.values():
                os.close(fd)
            self._dfds = {}
            return
        self._shard_dfd = np.array([self._dfds[s.path] for s in self.shards], dtype=np.int32)
        self._seen = np.zeros(1 << 20, dtype=np.uint8)  # doorkeeper: pages already read with O_DIRECT
        self._seen_n = 0
        self._vec = np.zeros(2, dtype=np.uint8)
        self._scratch_map = None
        self._scratch = None
        self._plan = None
        self._mm = mm
        self._direct_ok = True
        self._direct_compiled = self._nat is None
        self.direct_resident_check = False

    def _direct_buffers(self, n: int) -> None:
        np = self._np
        from .native import SCRATCH

        if self._scratch is None or self._scratch.shape[0] < n * SCRATCH:
            rows = max(n, 64)
            self._scratch = None
            if self._scratch_map is not None:
                self._scratch_map.close()
            self._scratch_map = self._mm.mmap(-1, rows * SCRATCH)  # page-aligned: O_DIRECT needs it
            self._scratch = np.frombuffer(self._scratch_map, np.uint8)
            self._plan = (np.empty(rows, np.int32), np.empty(rows, np.int64), np.empty(rows, np.int64),
                          np.empty(rows, np.int64), np.empty(rows, np.int64), np.empty(rows, np.int64))

    def _take(self, flat, out):
        if self._nat is not None:  # one compiled loop (releases the GIL: pool threads run in parallel)
            if self._nat.gather(self._region_u8, self._shard_off, self.rows_per_shard, self.row_bytes,
                                self.num_rows, flat, out) >= 0:
                self._check(flat)  # raises, naming the id
            return
        # Fancy indexing, not np.take: take() first copies a non-contiguous source whole.
        out.reshape(-1).view(self._rows_view.dtype)[...] = self._rows_view[self._offsets(flat)]

    def _direct(self, flat, out) -> bool:
        """The ``direct`` strategy (see the module doc). Returns True when nothing was read (warm)."""
        from . import native

        n = flat.shape[0]
        self._direct_buffers(n)
        p_fd, p_off, p_addr, p_len, p_row, p_skip = self._plan
        nat = self._nat or native
        plan = nat.plan_direct if self._nat else native.plan_direct_py
        k, nd = plan(self._region.base, self._shard_off, self._shard_fileoff, self._shard_fd, self._shard_dfd,
                     self.rows_per_shard, self.row_bytes, flat, out, self._region_u8, self._seen,
                     out.ctypes.data, self._scratch.ctypes.data, self._vec, p_fd, p_off, p_addr, p_len, p_row, p_skip,
                     self.direct_resident_check)
        if k == 0:
            return True
        self._seen_n += nd
        if self._seen_n >= self._seen.shape[0] // 8:  # keep the doorkeeper's false positives rare
            self._seen[:] = 0
            self._seen_n = 0
        with self._lock:
            res = self._ring.read_batch(p_fd[:k], p_off[:k], p_addr[:k], p_len[:k], depth=self.config.ring_depth)
            inline = nd == 0 and self._ring.last_inline == k  # only cached buffered reads: warm
        ext = self._nat.extract_direct if self._nat else native.extract_direct_py
        bad = ext(self._scratch, self.row_bytes, k, p_row, p_skip, p_len, res, out)
        for i in p_row[:bad].tolist():  # a failed read: that row through the mapping
            self._take(flat[i : i + 1], out[i : i + 1])
        return inline

    def _uring(self, flat, out):
        np = self._np
        s, local = np.divmod(flat, self.rows_per_shard)
        n = flat.shape[0]
        rb = self.row_bytes
        offs = self._shard_fileoff[s] + local * rb
        addrs = out.ctypes.data + np.arange(n, dtype=np.int64) * rb
        with self._lock:
            res = self._ring.read_batch(self._shard_fd[s], offs, addrs, np.full(n, rb, np.int64),
                                        depth=self.config.ring_depth)
            inline = self._ring.last_inline == n
        bad = np.nonzero(res != rb)[0]
        for i in bad.tolist():  # short read / error: finish that row through the mapping
            self._take(flat[i : i + 1], out[i : i + 1])
        return inline

    def _willneed(self, flat):
        np = self._np
        a = self._region.base + self._offsets(flat)
        p0 = a & ~(PAGE - 1)
        p1 = (a + self.row_bytes - 1) & ~(PAGE - 1)
        starts = np.unique(p0) if flat.shape[0] > 1 else p0
        lens = np.full(starts.shape[0], PAGE, dtype=np.int64)
        span2 = np.unique(p1[p1 != p0])
        if span2.size:
            starts = np.concatenate([starts, span2])
            lens = np.full(starts.shape[0], PAGE, dtype=np.int64)
        self._prefetcher.willneed(starts.astype(np.uint64), lens.astype(np.uint64))

    def _pool_gather(self, flat, out):
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="ple-gather")
        n = flat.shape[0]
        step = max(1, min(self.config.chunk, -(-n // self.config.workers)))
        parts = [(a, min(n, a + step)) for a in range(0, n, step)]
        list(self._pool.map(lambda ab: self._take(flat[ab[0]:ab[1]], out[ab[0]:ab[1]]), parts))

    def _gather_into(self, flat, out) -> str:
        """Rows of ``flat`` (range-checked) into ``out`` (n, row_bytes) uint8; returns the strategy."""
        n = flat.shape[0]
        fr = self.config.fast_rows
        if n == 0:
            return "empty"
        if fr and n <= fr:
            self._take(flat, out)
            return "take"
        if self._warm >= 1:
            # Pages were all cached lately: read through the mapping (big batches over the pool).
            # A major fault means the guess was wrong (that row waited alone): back to the cold
            # paths at once.
            f0 = io_mark()
            if n > 4096:
                self._pool_gather(flat, out)
            else:
                self._take(flat, out)
            if io_mark() != f0:
                self._warm = 0
            return "take"
        size_class = 0 if n <= 4096 else 1
        strat = self._pick(size_class) if self.io == "uring" else "mmap"
        if strat == "direct" and not self._direct_compiled:
            self._direct(flat[:0], out[:0])  # compile outside the timing
            self._direct_compiled = True
        t0 = time.perf_counter()
        f0 = io_mark()
        if strat == "uring":
            inline = self._uring(flat, out)
            cold = not inline or io_mark() != f0
        elif strat == "direct":
            cold = not self._direct(flat, out) or io_mark() != f0
        else:
            strat = self._mmap_gather(flat, out)
            cold = io_mark() != f0
        self._warm = 0 if cold else self._warm + 1
        if cold and self.io == "uring":
            self._learn(size_class, strat if strat in ("uring", "direct") else "mmap", (time.perf_counter() - t0) / n)
        return strat

    def _mmap_gather(self, flat, out) -> str:
        self._willneed(flat)
        if flat.shape[0] <= 4096:
            self._take(flat, out)
            return "willneed"
        self._pool_gather(flat, out)
        return "pool"


class TimedPicker:
    """Which cold path is fastest, timed per size class (state: `_ewma`, `_cold_n`)."""

    # Which cold path is faster depends on the machine (16-core host: the ring; a loaded 2-core
    # VM: WILLNEED + faults). With io=auto both are timed on cold batches (per-row EWMA, per size
    # class) and the faster one is used, trying the other on every 16th cold batch.
    def _pick(self, size_class: int) -> str:
        if self.config.io == "uring":
            return "uring"
        if self.config.io == "direct":
            return "direct" if size_class == 0 else "uring"
        e = self._ewma[size_class]
        c = self._cold_n[size_class] = self._cold_n[size_class] + 1
        for k in e:
            if e[k] is None:
                return k
        best = min(e, key=e.get)
        if c % 16 == 0:  # now and then, one of the others (in turn): the disk and the load change
            others = [k for k in e if k != best]
            return others[(c // 16) % len(others)]
        return best

    def _learn(self, size_class: int, strat: str, per_row: float) -> None:
        e = self._ewma[size_class]
        e[strat] = per_row if e[strat] is None else 0.8 * e[strat] + 0.2 * per_row
