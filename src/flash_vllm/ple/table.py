"""The PLE table, mapped from the checkpoint's safetensors shards, and its gather strategies.

Layout. Each file that holds table shards is mapped read-only (only the page range covering its
shards) into ONE reserved virtual region, so every row of every shard has one byte offset into one
numpy array. That array is viewed as overlapping ``V{row_bytes}`` items (stride 1 byte), and a
gather of any rows from any shards is one ``np.take`` call: no per-shard loop, no Python per row,
and ``out=`` can be the pinned staging buffer.

Strategies (``gather``; results are always bit-identical to ``table[ids]``):

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
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os
import re
import resource
import threading
import time
from dataclasses import dataclass

from flash_common.stheader import HeaderError, read_header, read_index

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

SUPPORTED_DTYPES = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4}
SHARD_RE = re.compile(r"^(?P<prefix>.*layers\.(?P<layer>\d+)\.ple\.ple_embedding\.ngram_embedding\.)shard_(?P<k>\d+)\.weight$")


class PLETableError(ValueError):
    """The checkpoint does not hold a usable PLE table; the message says which file and why."""


@dataclass(frozen=True)
class ShardSpec:
    index: int
    path: str
    begin: int  # absolute byte offset of row 0 in the file
    rows: int


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
_MAP_FAILED = ctypes.c_void_p(-1).value


def _io_mark() -> int:
    """Major faults + blocks read from disk so far, whole process (pool threads fault too; I/O that
    readahead, WILLNEED or io_uring starts on our behalf is accounted to us). A change means a
    gather touched the disk: it was cold."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_majflt + r.ru_inblock


def _thread_io_mark() -> int:
    """The same for this thread only (cheaper; enough for a copy that runs in this thread)."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_majflt + r.ru_inblock


def _oserr(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


class _Region:
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


class _Prefetcher:
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


def _read_scalar(path: str, t) -> float:
    import numpy as np

    if t.numel != 1:
        raise PLETableError(f"{path}: {t.name} has shape {list(t.shape)}, expected one value")
    with open(path, "rb") as f:
        f.seek(t.begin)
        raw = f.read(t.nbytes)
    if t.dtype == "F32":
        return float(np.frombuffer(raw, "<f4")[0])
    if t.dtype == "F16":
        return float(np.frombuffer(raw, "<f2")[0])
    if t.dtype == "BF16":
        return float((np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)[0])
    raise PLETableError(f"{path}: {t.name} has dtype {t.dtype}, expected F32/BF16/F16")


def find_table(model_dir: str, layer: int | None = None):
    """Locate the table's shards through the index. Returns (prefix, shards, dtype, width, scale, buffers)."""
    try:
        wmap = read_index(model_dir)
    except HeaderError as e:
        raise PLETableError(str(e)) from None
    found: dict[str, dict[int, str]] = {}
    for name, fname in wmap.items():
        m = SHARD_RE.match(name)
        if m and (layer is None or int(m.group("layer")) == layer):
            found.setdefault(m.group("prefix"), {})[int(m.group("k"))] = fname
    if not found:
        what = f"layer {layer}" if layer is not None else "any layer"
        raise PLETableError(f"{model_dir}: no '…ple.ple_embedding.ngram_embedding.shard_<k>.weight' tensors for {what} in the index")
    if len(found) > 1:
        raise PLETableError(f"{model_dir}: PLE tables on several layers ({', '.join(sorted(found))}); pass layer=")
    prefix, by_k = next(iter(found.items()))
    ks = sorted(by_k)
    if ks != list(range(len(ks))):
        missing = sorted(set(range(ks[-1] + 1)) - set(ks))
        raise PLETableError(f"{model_dir}: table shards are not contiguous; missing shard(s) {missing[:8]}")
    headers = {}

    def hdr(fname):
        if fname not in headers:
            p = os.path.join(model_dir, fname)
            try:
                headers[fname] = read_header(p)
            except HeaderError as e:
                raise PLETableError(str(e)) from None
        return headers[fname]

    shards, dtype, width = [], None, None
    for k in ks:
        fname = by_k[k]
        name = f"{prefix}shard_{k}.weight"
        h = hdr(fname)
        t = h.tensors.get(name)
        if t is None:
            raise PLETableError(f"{h.path}: index maps {name} here but the file's header does not hold it")
        if t.dtype not in SUPPORTED_DTYPES:
            raise PLETableError(f"{h.path}: {name} has dtype {t.dtype} (supported: {', '.join(SUPPORTED_DTYPES)})")
        if len(t.shape) != 2:
            raise PLETableError(f"{h.path}: {name} has shape {list(t.shape)}, expected [rows, width]")
        if dtype is None:
            dtype, width = t.dtype, t.shape[1]
        elif (t.dtype, t.shape[1]) != (dtype, width):
            raise PLETableError(f"{h.path}: {name} is {t.dtype} x {t.shape[1]} but shard 0 is {dtype} x {width}")
        shards.append(ShardSpec(k, h.path, t.begin, t.shape[0]))
    scale = None
    sname = f"{prefix}weight_scale"
    if sname in wmap:
        h = hdr(wmap[sname])
        t = h.tensors.get(sname)
        if t is None:
            raise PLETableError(f"{h.path}: index maps {sname} here but the file's header does not hold it")
        scale = _read_scalar(h.path, t)
    if dtype.startswith("F8") and scale is None:
        raise PLETableError(f"{model_dir}: fp8 table without {sname}: rows cannot be dequantized")
    buffers = {}
    base = prefix[: -len("ngram_embedding.")]
    for b in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"):
        if base + b in wmap:
            h = hdr(wmap[base + b])
            t = h.tensors.get(base + b)
            if t is not None and t.dtype == "I64" and t.nbytes <= 1 << 16:
                import numpy as np

                with open(h.path, "rb") as f:
                    f.seek(t.begin)
                    buffers[b] = np.frombuffer(f.read(t.nbytes), "<i8").copy()
    return prefix, shards, dtype, width, scale, buffers


class PLETable:
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
        if dtype not in SUPPORTED_DTYPES:
            raise PLETableError(f"table dtype {dtype} is not one of {', '.join(SUPPORTED_DTYPES)}")
        if not shards:
            raise PLETableError("no shards")
        self.dtype, self.head_dim, self.scale = dtype, int(width), scale
        self.row_bytes = self.head_dim * SUPPORTED_DTYPES[dtype]
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
            self._region = _Region(pieces)
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
        self._prefetcher = _Prefetcher()
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

    # -- strategies --------------------------------------------------------------------------
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
            f0 = _io_mark()
            if n > 4096:
                self._pool_gather(flat, out)
            else:
                self._take(flat, out)
            if _io_mark() != f0:
                self._warm = 0
            return "take"
        size_class = 0 if n <= 4096 else 1
        strat = self._pick(size_class) if self.io == "uring" else "mmap"
        if strat == "direct" and not self._direct_compiled:
            self._direct(flat[:0], out[:0])  # compile outside the timing
            self._direct_compiled = True
        t0 = time.perf_counter()
        f0 = _io_mark()
        if strat == "uring":
            inline = self._uring(flat, out)
            cold = not inline or _io_mark() != f0
        elif strat == "direct":
            cold = not self._direct(flat, out) or _io_mark() != f0
        else:
            strat = self._mmap_gather(flat, out)
            cold = _io_mark() != f0
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
                f0 = _thread_io_mark()
                self._take(flat, out)
                r = -2 if _thread_io_mark() != f0 else -1
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
