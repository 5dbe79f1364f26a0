"""Patch 1's shared guard: the per-process PLE tables and the guarded host gather, used by both
flavours (`__init__.py` for 0.30+, `v029.py` for 0.29), as patch 5's `hook.py` is for 5 and 8.
A leaf: it imports neither flavour, so the two never import each other back."""

from __future__ import annotations

import logging
import os
import re
import threading

log = logging.getLogger("vllm.flash")

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(prefix: str) -> int | None:
    """Decoder layer index of a module prefix (`model.layers.3.ple...` -> 3), None if absent."""
    m = _LAYER_RE.search(prefix)
    return int(m.group(1)) if m else None


def table_dir(cfg_source_dir: str | None, model_path: str | None) -> str:
    """Where the shards are read: VLLM_PLE_MMAP_DIR, else vLLM's model path (a local directory)."""
    d = cfg_source_dir or model_path
    if not d:
        raise ValueError("VLLM_PLE_MMAP: no table directory (set VLLM_PLE_MMAP_DIR or serve a local "
                         "model directory)")
    if not os.path.isdir(d):
        raise ValueError(f"VLLM_PLE_MMAP: table directory {d!r} is not a local directory (a snapshot "
                         "path or VLLM_PLE_MMAP_DIR is needed)")
    return d


class Tables:
    """One table (`PLETable`, or `NvFp4Table` for ModelOpt NVFP4 checkpoints) per (directory, layer)
    and one `PLEStats` per process, opened on first use."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tables: dict[tuple[str, int | None], object] = {}
        self.stats = None
        self.config = None

    def get(self, model_path: str | None, layer: int | None, env=None):
        from ... import ple

        with self._lock:
            if self.config is None:
                self.config = ple.config_from_env(os.environ if env is None else env)
                self.stats = ple.PLEStats(stats_sec=self.config.stats_sec, prometheus=self.config.prometheus)
            d = table_dir(self.config.source_dir, model_path)
            key = (d, layer)
            if key not in self._tables:
                t = ple.open_table(d, layer=layer, config=self.config, stats=self.stats)  # FP8/BF16 rows or NVFP4
                log.info("flash_vllm patch 1: %s (layer %s, %s)", t.describe(), layer, d)
                self._tables[key] = t
            return self._tables[key]


TABLES = Tables()


def _is_capturing(torch) -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _in_breakable_capture() -> bool:
    """True while a breakable CUDA-graph capture runs, its eager segments included: the ids
    computed before us were recorded, not run, so they are garbage. `add_eager` ends the current
    segment (`_capturing` is False) before it runs the eager function once at capture time, so
    the context being active is what counts, not `_capturing`. Replay runs outside the context."""
    try:
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    except ImportError:
        return False
    return BreakableCUDAGraphCapture.current() is not None


def eager_break(fn):
    """`fn` as an eager break of a breakable CUDA-graph capture when the release has them and
    they are on. Call at layer init: the decorator reads VLLM_USE_BREAKABLE_CUDAGRAPH when applied,
    which VllmConfig sets before the model is built."""
    try:
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    except ImportError:  # pragma: no cover - check() pins it on every base we ship code for
        return fn
    return eager_break_during_capture(fn)


def gather_into(stager, ngram_ids, out, raw: bool = False) -> None:
    """The guarded host gather every base uses: `stager(device).lookup(ids, out=out)`.

    Refuses inside a plain stream capture (a FULL graph would replay a constant) and zero-fills
    during a breakable capture (the ids queued before it were recorded, not computed)."""
    import torch

    if _is_capturing(torch):
        raise RuntimeError("VLLM_PLE_MMAP: the PLE gather is being captured into a FULL CUDA "
                           "graph; serve with --compilation-config "
                           "'{\"cudagraph_mode\":\"PIECEWISE\"}' (on vLLM 0.29 also leave "
                           "splitting_ops unset so vllm::flash_ple_mmap_lookup stays a splitting op)")
    if _in_breakable_capture():
        out.zero_()  # capture-time run of the eager segment; replay does the real gather
        return
    stager(out.device).lookup(ngram_ids, out=out, raw=raw)
