"""PLE engine settings from the environment the run spec passes (``VLLM_PLE_MMAP_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

# the Stager's captured-graph limit (rows per lookup); bigger batches run its eager device part
GRAPH_MAX_ROWS = 1024

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class PLEConfigError(ValueError):
    """A VLLM_PLE_MMAP_* value the engine cannot use; names the variable and what is accepted."""


@dataclass(frozen=True)
class PLEConfig:
    enabled: bool = False
    workers: int = 32
    prewarm: bool = False
    madvise: str = "random"
    fast_rows: int = 0  # 0: the strategy picks; N > 0: batches of <= N rows read inline (upstream meaning)
    stats_sec: float = 30.0
    prometheus: bool = True
    source_dir: str | None = None
    ring_depth: int = 256  # reads in flight per gather (io_uring)
    chunk: int = 2048  # rows per pool task (upstream VLLM_PLE_MMAP_CHUNK)
    io: str = "auto"  # auto | uring | direct | mmap (mmap = madvise WILLNEED + faults, no io_uring)
    native: bool = True  # compiled (numba) gather loops when numba is importable
    debug: bool = False  # patch 1: cross-check every gather's ids (device sync + host reference); slow
    mode: str = "eager"  # eager: gather inside the forward | hoisted: before it (patch 1's hoist.py)
    hoist_check: bool = False  # hoisted: eager forwards compare the ids with those gathered for (syncs)
    # Stager: batches of >= this many rows upload distinct rows + an inverse (eager device part);
    # smaller ones replay a captured graph. Just past the graph limit: every batch that can replay a
    # graph does. At 256, c=8 x MTP=2 decode (384 rows) took the dedup side (decode-h200/run6: +1.5 ms
    # per step there vs +0.4 at c=1/4); decode rows are nearly all distinct, so dedup saved nothing.
    dedup_min: int = GRAPH_MAX_ROWS + 1


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise PLEConfigError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no)")


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw.strip(), 10)
    except ValueError:
        raise PLEConfigError(f"{name}={raw!r} is not an integer (accepted: {lo}..{hi})") from None
    if not lo <= v <= hi:
        raise PLEConfigError(f"{name}={v} is out of range (accepted: {lo}..{hi})")
    return v


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v not in allowed:
        raise PLEConfigError(f"{name}={raw!r} is not one of {', '.join(allowed)}")
    return v


def config_from_env(env: Mapping[str, str]) -> PLEConfig:
    """Validate every ``VLLM_PLE_MMAP*`` variable; unknown ``VLLM_PLE_MMAP_*`` names are an error."""
    known = {
        "VLLM_PLE_MMAP", "VLLM_PLE_MMAP_WORKERS", "VLLM_PLE_MMAP_PREWARM", "VLLM_PLE_MMAP_MADVISE",
        "VLLM_PLE_MMAP_FAST_ROWS", "VLLM_PLE_MMAP_STATS_SEC", "VLLM_PLE_MMAP_PROMETHEUS",
        "VLLM_PLE_MMAP_DIR", "VLLM_PLE_MMAP_RING_DEPTH", "VLLM_PLE_MMAP_IO", "VLLM_PLE_MMAP_CHUNK",
        "VLLM_PLE_MMAP_NATIVE", "VLLM_PLE_MMAP_DEBUG", "VLLM_PLE_MMAP_MODE", "VLLM_PLE_MMAP_HOIST_CHECK",
        "VLLM_PLE_MMAP_DEDUP_MIN",
    }
    unknown = sorted(k for k in env if k.startswith("VLLM_PLE_MMAP_") and k not in known)
    if unknown:
        raise PLEConfigError(f"unknown PLE setting(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    # Upstream also accepted "1" for random.
    madv_env = dict(env)
    if (madv_env.get("VLLM_PLE_MMAP_MADVISE") or "").strip() == "1":
        madv_env["VLLM_PLE_MMAP_MADVISE"] = "random"
    raw_stats = env.get("VLLM_PLE_MMAP_STATS_SEC")
    stats_sec = 30.0
    if raw_stats is not None and raw_stats.strip() != "":
        try:
            stats_sec = float(raw_stats)
        except ValueError:
            raise PLEConfigError(f"VLLM_PLE_MMAP_STATS_SEC={raw_stats!r} is not a number of seconds (<= 0 disables)") from None
        if stats_sec != stats_sec or stats_sec in (float("inf"), float("-inf")):
            raise PLEConfigError(f"VLLM_PLE_MMAP_STATS_SEC={raw_stats!r} must be finite")
    src = env.get("VLLM_PLE_MMAP_DIR") or None
    return PLEConfig(
        enabled=_bool(env, "VLLM_PLE_MMAP", False),
        workers=_int(env, "VLLM_PLE_MMAP_WORKERS", 32, 1, 1024),
        prewarm=_bool(env, "VLLM_PLE_MMAP_PREWARM", False),
        madvise=_choice(madv_env, "VLLM_PLE_MMAP_MADVISE", "random", ("random", "normal")),
        fast_rows=_int(env, "VLLM_PLE_MMAP_FAST_ROWS", 0, 0, 1 << 24),
        stats_sec=stats_sec,
        prometheus=_bool(env, "VLLM_PLE_MMAP_PROMETHEUS", True),
        source_dir=src,
        ring_depth=_int(env, "VLLM_PLE_MMAP_RING_DEPTH", 256, 1, 4096),
        chunk=_int(env, "VLLM_PLE_MMAP_CHUNK", 2048, 1, 1 << 24),
        io=_choice(env, "VLLM_PLE_MMAP_IO", "auto", ("auto", "uring", "direct", "mmap")),
        native=_bool(env, "VLLM_PLE_MMAP_NATIVE", True),
        debug=_bool(env, "VLLM_PLE_MMAP_DEBUG", False),
        mode=_choice(env, "VLLM_PLE_MMAP_MODE", "eager", ("eager", "hoisted")),
        hoist_check=_bool(env, "VLLM_PLE_MMAP_HOIST_CHECK", False),
        dedup_min=_int(env, "VLLM_PLE_MMAP_DEDUP_MIN", PLEConfig.dedup_min, 1, 1 << 24),
    )
