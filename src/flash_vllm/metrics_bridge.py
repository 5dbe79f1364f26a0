"""Carry the PLE counters from the engine process(es) to the API server's single-process /metrics.

Why: the PLE lookup runs in vLLM's EngineCore/worker process, /metrics is served by the API
server from prometheus_client's default REGISTRY. A counter lives in the registry of the process
that made it, so without help the counters only show in multiprocess mode, which drops every
``*_created`` family and the process/python collectors (docs/OBSERVABILITY.md). The bridge keeps
single-process mode and adds exactly the nine ``vllm:ple_mmap_*`` families:

* engine side (``attach(stats)``, called by ``PLEStats``): one small JSON record per process,
  ``<dir>/ple-<pidns>-<pid>-<starttime>.json``, atomically replaced (tmp sibling + rename, so a
  reader never sees a partial write) by a daemon thread at most every ``FLASH_METRICS_INTERVAL_MS``
  (default 1000) and only when a total moved; once more at exit. The lookup path is untouched: the
  thread reads the totals ``PLEStats.record`` already keeps.
* API side (``install()``, called once from ``flash_vllm.plugin.register``): a prometheus_client
  ``Collector`` in the default REGISTRY that sums, at scrape time, the records written by this
  process or its descendants (the writer records its ancestry), so a second server on the same
  host is never counted. Records of dead descendants stay in the sum (a counter never goes down
  while the server lives); the start-time gauge is the newest engine start. Records of finished
  servers (writer dead and the server's root process dead) are deleted.

Identity is (pid namespace, pid, start time in clock ticks), so a reused pid or another container
sharing /dev/shm is never mistaken for ours. With ``PROMETHEUS_MULTIPROC_DIR`` set the bridge stays
out of the way (PLEStats registers native counters, prometheus_client aggregates them: no double
counting). ``FLASH_METRICS_BRIDGE=0`` turns it off. Every failure is logged once and swallowed: the
bridge never breaks a lookup or a scrape.

Directory: ``$FLASH_METRICS_DIR``, else ``/dev/shm/flash-metrics-<uid>``, else
``<tmp>/flash-metrics-<uid>``; created 0700 and refused when it is a symlink or not ours.
No vLLM import anywhere; prometheus_client only inside functions.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping

log = logging.getLogger("vllm.flash.metrics_bridge")

ROOT_ENV = "FLASH_METRICS_ROOT"        # "pid:start" of the process that installed the collector
FORMAT = 1
MAX_RECORD_BYTES = 1 << 16
MAX_RECORDS = 4096                     # bound on the work one scrape does
GC_EVERY_S = 60.0
HEARTBEAT_S = 300.0                    # a live writer rewrites its record at least this often
FOREIGN_STALE_S = 86400.0              # another pid namespace's record untouched this long: its writer is gone
_OFF = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}
_NAME = re.compile(r"^ple-(\d+)-(\d+)-(\d+)\.json$")
_TMP = re.compile(r"^\.ple-(\d+)-(\d+)-(\d+)\.\d+\.tmp$")


# --- identity ---------------------------------------------------------------------------------

def _stat(pid: int | str) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks since boot) of a live process, else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _pidns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start


def identity() -> tuple[int, int, int]:
    """(pid namespace inode, pid, start ticks) of this process."""
    st = _stat("self")
    if st is None:
        raise OSError("/proc/self/stat unreadable")
    return _pidns(), os.getpid(), st[1]


def lineage(pid: int) -> list[list[int]]:
    """[[pid, start], ...] of the ancestors of `pid`, nearest first, up to pid 1."""
    out = []
    st = _stat(pid)
    for _ in range(64):
        if st is None or st[0] <= 0:
            break
        ppid = st[0]
        st = _stat(ppid)
        if st is None:
            break
        out.append([ppid, st[1]])
    return out


# --- configuration ----------------------------------------------------------------------------

def mode(env: Mapping[str, str] | None = None) -> str:
    """"multiprocess" (prometheus_client's own path), "off", or "bridge"."""
    env = os.environ if env is None else env
    if env.get("PROMETHEUS_MULTIPROC_DIR"):
        return "multiprocess"
    if env.get("FLASH_METRICS_BRIDGE", "1").strip().lower() in _OFF:
        return "off"
    if not os.path.exists("/proc/self/stat"):
        return "off"
    return "bridge"


def interval_s(env: Mapping[str, str] | None = None) -> float:
    env = os.environ if env is None else env
    raw = env.get("FLASH_METRICS_INTERVAL_MS", "1000")
    try:
        ms = float(raw)
    except ValueError:
        log.warning("FLASH_METRICS_INTERVAL_MS=%r is not a number of milliseconds; using 1000", raw)
        ms = 1000.0
    return min(max(ms, 10.0), 60000.0) / 1000.0


def directory(env: Mapping[str, str] | None = None, create: bool = True) -> Path:
    """The records' directory (see the module doc); raises OSError when it is unusable."""
    env = os.environ if env is None else env
    explicit = env.get("FLASH_METRICS_DIR")
    if explicit:
        candidates = [Path(explicit)]
    else:
        name = f"flash-metrics-{os.geteuid()}"
        candidates = [Path("/dev/shm") / name, Path(tempfile.gettempdir()) / name]
    err: OSError | None = None
    for d in candidates:
        try:
            if create:
                d.mkdir(mode=0o700, parents=bool(explicit), exist_ok=True)
            st = os.lstat(d)
            import stat as _s

            if _s.S_ISLNK(st.st_mode) or not _s.S_ISDIR(st.st_mode):
                raise OSError(f"{d} is not a plain directory")
            if st.st_uid != os.geteuid():
                raise OSError(f"{d} belongs to uid {st.st_uid}, not {os.geteuid()}")
            if create and not os.access(d, os.W_OK | os.X_OK):
                raise OSError(f"{d} is not writable")
            return d
        except OSError as e:
            err = e
    raise err or OSError("no usable directory")


# --- engine side: the per-process publisher ---------------------------------------------------

class Publisher:
    """Publishes the summed totals of this process's PLEStats objects to its record file."""

    def __init__(self, dirpath: Path, interval: float):
        self.dir = dirpath
        self.interval = interval
        self.ns, self.pid, self.start = identity()
        self.lineage = lineage(self.pid)
        root = os.environ.get(ROOT_ENV, "")
        self.root = root if re.fullmatch(r"\d+:\d+", root) else f"{self.pid}:{self.start}"
        self.path = dirpath / f"ple-{self.ns}-{self.pid}-{self.start}.json"
        self.started = time.time()   # counters' *_created and the engine start-time gauge
        self.stats: list = []        # strong refs: a collected PLEStats must keep its counts
        self._lock = threading.Lock()
        self._last: dict | None = None
        self._last_write = 0.0
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def attach(self, stats) -> None:
        with self._lock:
            self.stats.append(stats)
        # the families exist (at 0) as soon as the engine does; a first write that fails hands the
        # stats back to native counters (the caller falls back)
        if not self.publish(force=True) and self._last is None:
            with self._lock:
                self.stats.remove(stats)
            raise OSError(f"cannot write {self.path}")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flash-metrics-bridge", daemon=True)
            self._thread.start()

    def totals(self) -> dict:
        from .ple.stats import PLEStats

        out = dict.fromkeys(PLEStats.FIELDS, 0)
        with self._lock:
            stats = list(self.stats)
        for s in stats:
            for k, v in s.snapshot()["total"].items():
                if k in out:
                    out[k] += v
        return out

    def publish(self, force: bool = False) -> bool:
        try:
            values = self.totals()
            if not force and values == self._last and time.monotonic() - self._last_write < HEARTBEAT_S:
                return False
            self._seq += 1
            doc = {"format": FORMAT, "ns": self.ns, "pid": self.pid, "start": self.start,
                   "lineage": self.lineage, "root": self.root, "created": self.started,
                   "engine_start": self.started, "seq": self._seq, "time": time.time(), "values": values}
            tmp = self.dir / f".ple-{self.ns}-{self.pid}-{self.start}.{threading.get_ident()}.tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as fh:
                    fh.write(json.dumps(doc, separators=(",", ":")))
                os.replace(tmp, self.path)
            except BaseException:
                try:  # e.g. a full /dev/shm: the last whole record stays, no torn tmp left behind
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            self._last = values
            self._last_write = time.monotonic()
            return True
        except Exception as e:  # never let metrics break the engine
            if not self._failed:
                self._failed = True
                _warn("PLE metrics bridge: cannot publish to %s (%s)", self.path, e)
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish()

    def close(self) -> None:
        self._stop.set()
        self.publish()


_pub_lock = threading.Lock()
_publisher: Publisher | None = None


def wire() -> None:
    """Make every PLEStats this process creates publish through `attach` (what `register()` does:
    the stats module is told its publisher, it never imports this one)."""
    from .ple.stats import set_publisher

    set_publisher(attach)


def attach(stats) -> Publisher | None:
    """Publish `stats` (a PLEStats) through this process's record; None when the bridge is not
    the path (multiprocess mode, turned off) or unusable (then PLEStats keeps native counters)."""
    global _publisher
    try:
        if mode() != "bridge":
            return None
        with _pub_lock:
            if _publisher is None or _publisher.pid != os.getpid():
                _publisher = Publisher(directory(), interval_s())
                atexit.register(_publisher.close)
                try:  # multiprocessing children leave through os._exit: flush in its finalizers too
                    from multiprocessing import util

                    util.Finalize(_publisher, _publisher.close, exitpriority=100)
                except Exception:
                    pass
            pub = _publisher
        pub.attach(stats)
        return pub
    except Exception as e:
        _warn("PLE metrics bridge unavailable, native counters instead (%s)", e)
        return None


def _after_fork_in_child() -> None:
    # a forked child neither owns the parent's record nor its thread; PLEStats made here attach anew
    global _publisher
    _publisher = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- API side: the collector ------------------------------------------------------------------

def read_records(dirpath: Path, ns: int | None = None) -> list[dict]:
    """Every well-formed record in the directory (of pid namespace `ns` when given)."""
    out = []
    try:
        entries = []
        for e in os.scandir(dirpath):
            m = _NAME.match(e.name)
            if m and (ns is None or int(m.group(1)) == ns):
                entries.append((e, m))
        entries = sorted(entries, key=lambda em: em[0].name)[:MAX_RECORDS]
    except OSError:
        return out
    for e, m in entries:
        try:
            with open(e.path, "rb") as fh:
                raw = fh.read(MAX_RECORD_BYTES + 1)
            if len(raw) > MAX_RECORD_BYTES:
                continue
            doc = json.loads(raw)
            if (doc.get("format") != FORMAT or [doc["ns"], doc["pid"], doc["start"]] != [int(g) for g in m.groups()]
                    or not isinstance(doc.get("values"), dict)):
                continue
            doc["_path"] = e.path
            out.append(doc)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # vanished, or not ours: skip, never fail the scrape
    return out


def aggregate(records: list[dict], me: tuple[int, int, int]) -> dict | None:
    """Sum of the records of `me` and its descendants: {"values", "created", "engine_start", "n"}."""
    from .ple.stats import COUNTERS

    ns, pid, start = me
    mine = [r for r in records if r["ns"] == ns and ([r["pid"], r["start"]] == [pid, start]
                                                    or [pid, start] in r.get("lineage", []))]
    if not mine:
        return None
    values = dict.fromkeys(COUNTERS, 0.0)
    for r in mine:
        for k in values:
            v = r["values"].get(k, 0)
            if isinstance(v, (int, float)) and v == v and v >= 0:
                values[k] += float(v)
    return {"values": values, "created": min(float(r["created"]) for r in mine),
            "engine_start": max(float(r["engine_start"]) for r in mine), "n": len(mine)}


def collect_garbage(dirpath: Path, ns: int, min_age_s: float = 60.0) -> list[str]:
    """Delete records of finished servers: writer dead and its server's root process dead.
    Leftover tmp files of dead writers too. Another pid namespace's processes (another container
    sharing /dev/shm through --ipc=host) cannot be looked up: their records go only when untouched
    for FOREIGN_STALE_S (live writers rewrite every HEARTBEAT_S)."""
    removed = []
    now = time.time()
    for r in read_records(dirpath, ns):
        try:
            root_pid, root_start = (int(x) for x in str(r.get("root", "")).split(":"))
        except ValueError:
            root_pid, root_start = r["pid"], r["start"]
        if not alive(r["pid"], r["start"]) and not alive(root_pid, root_start):
            try:
                os.unlink(r["_path"])
                removed.append(r["_path"])
            except OSError:
                pass
    try:
        for e in os.scandir(dirpath):
            m = _TMP.match(e.name) or _NAME.match(e.name)
            if not m:
                continue
            try:
                age = now - e.stat(follow_symlinks=False).st_mtime
                if int(m.group(1)) != ns:
                    stale = age > FOREIGN_STALE_S
                else:  # our namespace's records were judged above; tmp files of dead writers
                    stale = e.name.endswith(".tmp") and age > min_age_s and not alive(int(m.group(2)), int(m.group(3)))
                if stale:
                    os.unlink(e.path)
                    removed.append(e.path)
            except OSError:
                continue
    except OSError:
        pass
    return removed


class PLEBridgeCollector:
    """prometheus_client collector: the nine vllm:ple_mmap_* families, summed over the records.

    No ``_name`` attribute on purpose: vLLM's ``unregister_vllm_metrics()`` drops collectors whose
    ``_name`` starts with ``vllm:`` when its stat logger starts.
    """

    def __init__(self, dirpath: Path | None = None, env: Mapping[str, str] | None = None):
        self._env = env
        self._dir = dirpath
        self._ident = identity()
        self._last_gc = 0.0
        self._warned = 0.0

    @property
    def _me(self) -> tuple[int, int, int]:
        if self._ident[1] != os.getpid():  # inherited through fork: aggregate for this process
            self._ident = identity()
        return self._ident

    def describe(self):
        # the names, so a native counter of the same name in this registry is refused, never doubled
        return list(self._families(None))

    def collect(self):
        try:
            env = os.environ if self._env is None else self._env
            if env.get("PROMETHEUS_MULTIPROC_DIR"):
                return []  # prometheus_client's multiprocess collector has them
            d = self._dir or directory(env, create=False)
            ns = self._me[0]
            now = time.monotonic()
            if now - self._last_gc > GC_EVERY_S:
                self._last_gc = now
                collect_garbage(d, ns)
            agg = aggregate(read_records(d, ns), self._me)
            return [] if agg is None else list(self._families(agg))
        except Exception as e:  # a scrape must never fail because of the bridge
            now = time.monotonic()
            if now - self._warned > 300:
                self._warned = now
                _warn("PLE metrics bridge: scrape skipped the PLE counters (%s)", e)
            return []

    @staticmethod
    def _families(agg: dict | None):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from .ple.stats import COUNTERS, START_GAUGE

        try:  # honour PROMETHEUS_DISABLE_CREATED_SERIES like native counters do
            from prometheus_client import metrics as _m

            use_created = bool(getattr(_m, "_use_created", True))
        except Exception:
            use_created = True
        for key, (name, doc) in COUNTERS.items():
            if agg is None:
                yield CounterMetricFamily(name, doc)
            else:
                yield CounterMetricFamily(name, doc, value=agg["values"][key],
                                          created=agg["created"] if use_created else None)
        g = GaugeMetricFamily(START_GAUGE[0], START_GAUGE[1])
        if agg is not None:
            g.add_metric([], agg["engine_start"])
        yield g


_install_lock = threading.Lock()
_installed: PLEBridgeCollector | None = None


def install(env: Mapping[str, str] | None = None, registry=None) -> str:
    """Register the collector (once per process) where /metrics is served. Returns what happened,
    for the log; never raises. Skipped unless the PLE patch runs with its counters on."""
    global _installed
    try:
        env = os.environ if env is None else env
        m = mode(env)
        if m != "bridge":
            return f"metrics bridge {m}"
        if env.get("VLLM_PLE_MMAP", "").strip().lower() not in _TRUE:
            return "metrics bridge idle (VLLM_PLE_MMAP off)"
        if env.get("VLLM_PLE_MMAP_PROMETHEUS", "1").strip().lower() in _OFF:
            return "metrics bridge idle (VLLM_PLE_MMAP_PROMETHEUS=0)"
        with _install_lock:
            if _installed is not None:
                return "metrics bridge on"
            _, pid, start = identity()
            # the server's root: descendants inherit it, so records of a finished server can be
            # told from those of a live one (garbage collection only)
            os.environ.setdefault(ROOT_ENV, f"{pid}:{start}")
            d = directory(env)
            collector = PLEBridgeCollector(d, None if env is os.environ else env)
            if registry is None:
                from prometheus_client import REGISTRY as registry
            registry.register(collector)
            _installed = collector
            log.info("flash_vllm: PLE metrics bridge on, pid %d, records in %s", pid, d)
            return f"metrics bridge on ({d})"
    except Exception as e:
        _warn("PLE metrics bridge not installed (%s)", e)
        return f"metrics bridge failed ({e})"


def _warn(fmt: str, *args) -> None:
    try:
        log.warning(fmt, *args)
    except Exception:
        pass
