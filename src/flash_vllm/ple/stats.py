"""PLE lookup statistics: the periodic log line and the upstream Prometheus counters.

Failure-proof by construction: every metrics call is wrapped, a broken or missing
prometheus_client only produces one warning, and a lookup never fails because of metrics.

Log line (logger ``vllm.ple_mmap``, INFO, every ``stats_sec`` seconds, checked on each op); the
prefix is upstream's, which benchmark scripts parse, the suffix came later upstream::

    PLE mmap stats (last 30s): 120 ops, op 84.0 ms total (0.70 ms/op), gather 60.0 ms total
    (0.50 ms/op), 5760 rows, 0.9 MiB read, gpu-wait 0.01 ms/op, host 0.69 ms/op (dedup 0.05,
    gather 0.50, stage 0.14)

Counters (created lazily, once per process; ``vllm:`` names as upstream). Outside prometheus
multiprocess mode they are not registered here but carried to the API server's /metrics by
``flash_vllm.metrics_bridge`` (same names, types and help; ``FLASH_METRICS_BRIDGE=0``: native):
``vllm:ple_mmap_lookup_ops_total``, ``_op_seconds_total``, ``_gpu_wait_seconds_total``,
``_dedup_seconds_total``, ``_gather_seconds_total``, ``_stage_seconds_total``, ``_rows_total``,
``_bytes_total`` and the gauge ``vllm:ple_mmap_engine_start_time_seconds`` (restart marker).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

LOGGER_NAME = "vllm.ple_mmap"
_log = logging.getLogger(LOGGER_NAME)

COUNTERS = {
    "ops": ("vllm:ple_mmap_lookup_ops", "PLE mmap lookups (one per forward of the PLE layer)"),
    "op_s": ("vllm:ple_mmap_op_seconds", "Seconds in PLE lookups end to end (ids, gather, H2D)"),
    "gpu_wait_s": ("vllm:ple_mmap_gpu_wait_seconds", "Seconds waiting for the GPU before a lookup"),
    "dedup_s": ("vllm:ple_mmap_dedup_seconds", "Seconds deduplicating row ids"),
    "gather_s": ("vllm:ple_mmap_gather_seconds", "Seconds reading rows from the table (disk/page cache)"),
    "stage_s": ("vllm:ple_mmap_stage_seconds", "Seconds staging rows to the device"),
    "rows": ("vllm:ple_mmap_rows", "Table rows read"),
    "bytes": ("vllm:ple_mmap_bytes", "Table bytes read"),
}
START_GAUGE = ("vllm:ple_mmap_engine_start_time_seconds", "Unix time the PLE engine started (restart marker)")

_prom_lock = threading.Lock()
_prom = None  # dict key -> Counter, or False when unavailable


def _prom_metrics(registry=None):
    """Create the counters once per process (prometheus_client refuses duplicates)."""
    global _prom
    if registry is not None:
        return _make(registry)
    with _prom_lock:
        if _prom is None:
            try:
                _prom = _make(None)
            except Exception as e:  # no prometheus_client, duplicate registration, ...
                _log.warning("PLE mmap: Prometheus counters disabled (%s)", e)
                _prom = False
        return _prom


def _make(registry):
    from prometheus_client import REGISTRY, Counter, Gauge

    reg = REGISTRY if registry is None else registry
    out = {k: Counter(name, doc, registry=reg) for k, (name, doc) in COUNTERS.items()}
    g = Gauge(START_GAUGE[0], START_GAUGE[1], registry=reg, multiprocess_mode="max")
    g.set(time.time())
    out["_start"] = g
    return out


# Who publishes a PLEStats' totals for the /metrics process: injected by `flash_vllm.register()`
# (`metrics_bridge.wire()`), so this module never imports the bridge back. None: native counters.
_publisher: Callable[["PLEStats"], object] | None = None


def set_publisher(publisher: Callable[["PLEStats"], object] | None) -> None:
    """Inject the publisher every later PLEStats attaches to (None: native counters only)."""
    global _publisher
    _publisher = publisher


class PLEStats:
    """Accumulates per-op phase times; thread-safe; never raises from ``record``."""

    FIELDS = ("ops", "op_s", "gpu_wait_s", "dedup_s", "gather_s", "stage_s", "rows", "bytes")

    def __init__(self, stats_sec: float = 30.0, prometheus: bool = True, registry=None, logger=None,
                 clock=time.monotonic):
        self.stats_sec = stats_sec
        self._clock = clock
        self._lock = threading.Lock()
        self._win = dict.fromkeys(self.FIELDS, 0)
        self._total = dict.fromkeys(self.FIELDS, 0)
        self._since = clock()
        self._log = logger or _log
        self._prom = None
        self._bridge = None
        if prometheus:
            try:
                if registry is None and _publisher is not None:
                    # single-process /metrics: publish the totals for the API server's collector
                    # (the injected flash_vllm.metrics_bridge.attach); None in multiprocess mode
                    # -> native counters
                    self._bridge = _publisher(self)
                if self._bridge is None:
                    self._prom = _prom_metrics(registry) or None
            except Exception as e:
                self._log.warning("PLE mmap: Prometheus counters disabled (%s)", e)

    def record(self, **phases) -> None:
        """``record(ops=1, op_s=..., gather_s=..., rows=..., bytes=...)``; unknown keys are ignored."""
        try:
            with self._lock:
                for k, v in phases.items():
                    if k in self._win and v:
                        self._win[k] += v
                        self._total[k] += v
            if self._prom:
                for k, v in phases.items():
                    c = self._prom.get(k)
                    if c is not None and v:
                        c.inc(v)
        except Exception as e:  # metrics must never break a lookup
            try:
                self._log.debug("PLE mmap: stats record failed: %s", e)
            except Exception:
                pass

    def snapshot(self) -> dict:
        with self._lock:
            return {"window": dict(self._win), "total": dict(self._total), "window_s": self._clock() - self._since}

    def line(self, reset: bool = True) -> str:
        with self._lock:
            w = dict(self._win)
            secs = self._clock() - self._since
            if reset:
                self._win = dict.fromkeys(self.FIELDS, 0)
                self._since = self._clock()
        return format_line(w, secs)

    def maybe_log(self) -> bool:
        """Log the line when ``stats_sec`` elapsed and ops happened; returns whether it logged."""
        try:
            if self.stats_sec <= 0:
                return False
            if self._clock() - self._since < self.stats_sec:
                return False
            with self._lock:
                if not self._win["ops"]:
                    return False
            self._log.info("%s", self.line(reset=True))
            return True
        except Exception:
            return False


def format_line(w: dict, secs: float) -> str:
    ops = w.get("ops", 0) or 0
    per = (lambda s: s * 1e3 / ops) if ops else (lambda s: 0.0)
    op_s, g = w.get("op_s", 0.0), w.get("gather_s", 0.0)
    host = op_s - w.get("gpu_wait_s", 0.0)
    return (
        f"PLE mmap stats (last {secs:.0f}s): {ops} ops, op {op_s * 1e3:.1f} ms total ({per(op_s):.2f} ms/op), "
        f"gather {g * 1e3:.1f} ms total ({per(g):.2f} ms/op), {int(w.get('rows', 0))} rows, "
        f"{w.get('bytes', 0) / 2**20:.1f} MiB read, gpu-wait {per(w.get('gpu_wait_s', 0.0)):.2f} ms/op, "
        f"host {per(host):.2f} ms/op (dedup {per(w.get('dedup_s', 0.0)):.2f}, gather {per(g):.2f}, "
        f"stage {per(w.get('stage_s', 0.0)):.2f})"
    )
