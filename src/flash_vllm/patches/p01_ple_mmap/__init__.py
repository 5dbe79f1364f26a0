"""Patch 1: serve the PLE n-gram table from the mmapped checkpoint shards (`VLLM_PLE_MMAP=1`).

The table is 47.68 GiB. 0.30+ selects its storage class in `Qwen4ExpNGramEmbedding.__init__`:
`Qwen4ExpPLEDeviceEmbedding` (the whole table on the GPU) or, by default on 0.33
(`EngramConfig.cpu_offload=True`), `Qwen4ExpPLEPinnedHostEmbedding` (the whole table pinned in
host RAM for UVA). On GB10's unified memory either costs the full 48 GiB. With the gate on, both
names are replaced by subclasses of the release's `Qwen4ExpPLEEmbedding` that:

- allocate the weight on the `meta` device (no storage at all) and skip the
  `ngram_embedding.shard_<i>.weight` rows at load time (the checkpoint stays on disk); with 0.33's
  NVFP4 table method (ModelOpt's QAD export) the per-row block scales `shard_<i>.weight_scale` too
  (also allocated through the storage, so on `meta`), while the one F32 `weight_scale_2` loads as
  the stock parameter;
- open the table once per process and layer with the PLE engine (`ple.open_table` on
  `VLLM_PLE_MMAP_DIR` or vLLM's model path) and look rows up through `Stager(table, device)`,
  which dequantises fp8 rows with the table scale (NVFP4 rows: codes x block scale x
  weight_scale_2, decoded on the device by `ple.nvfp4.Decoder`) and counts through one `PLEStats`
  (the metrics bridge exports the `vllm:ple_mmap_*` counters);
- write into a persistent per-layer output buffer (`max_total_tokens` rows, allocated at the
  first eager call, i.e. the profile run, never during a capture);
- run the gather as `eager_break_during_capture` (wrapped at layer init, after VllmConfig has
  decided breakable graphs), zero-filling the buffer during the capture-time run of the eager
  segment (the ids queued before it are recorded, not computed, at that point) and refusing
  loudly when called inside a plain stream capture (a FULL graph would replay a constant).

Graph regime of the eager mode (this plugin's default when VLLM_PLE_MMAP_MODE is unset; the recipe's
on 0.29): PIECEWISE. Qwen4Exp backends report UNIFORM_BATCH, so under vLLM's default
FULL_AND_PIECEWISE uniform decode batches are captured FULL, where an eager break does not break and
a host gather would be baked into the graph. The run spec therefore forces
`--compilation-config {"cudagraph_mode":"PIECEWISE"}` with it. The hoisted mode
(`VLLM_PLE_MMAP_MODE=hoisted`, `hoist.py`, 0.30-0.33; the recipe's default there, PLE_MODE=auto)
gathers before the forward from the model runner's inputs; the forward only reads the buffer, so the
run spec keeps FULL_AND_PIECEWISE.

Bases, and the one place that tells them apart (`FLAVOURS`):
- 0.30-0.33, "storage": the storage classes above are replaced (the abstract base is in
  `nvidia/` on 0.30 and `common/` on 0.31+, found through the replaced class's MRO;
  `reduce_results` exists from 0.32 and is passed through).
- 0.29, "splitting-op" (`v029.py`): the table is a `VocabParallelEmbedding` inside
  `ple_layer.py`'s `Qwen4ExpNGramEmbedding`, looked up after the `qwen4_exp_compute_ple_ngram_ids`
  splitting op. Its class is replaced the same way (meta weight, shard rows skipped) and the lookup
  moves into a splitting op of ours (`vllm::flash_ple_mmap_lookup`, appended to 0.29's
  `CompilationConfig._attention_ops`) that gathers through the same guarded `gather_into`.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import threading

from flash_common import releases

from ...registry import (UNTRACED_GATE, Context, Gate, Patch, TargetMissing, expect_installed, expect_source,
                         install, original, resolve)
from .guard import TABLES, Tables, _is_capturing, eager_break, gather_into, layer_of, table_dir  # noqa: F401
from .hoist import BASES as HOIST_BASES
from .hoist import TARGETS as HOIST_TARGETS
from .v029 import TARGETS as V029_TARGETS

NUMBER = 1
ENV = "VLLM_PLE_MMAP"
# The catalogue's `ple_storage` capability; a release where it is None gets no code (not-ported).
FLAVOURS = {b: releases.cap(b, "ple_storage") for b in releases.ORDER if releases.cap(b, "ple_storage")}
NGRAM = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
PINNED = (NGRAM, "Qwen4ExpPLEPinnedHostEmbedding")
DEVICE = (NGRAM, "Qwen4ExpPLEDeviceEmbedding")
INIT = (NGRAM, "Qwen4ExpNGramEmbedding.__init__")
FORWARD = (NGRAM, "Qwen4ExpNGramEmbedding.forward")
LOAD = (NGRAM, "Qwen4ExpNGramEmbedding.load_weights")

# For the compile key: what of patch 1's env changes the code torch.compile traces.
TRACED = ("VLLM_PLE_MMAP_MODE", "VLLM_PLE_MMAP_DEBUG", "VLLM_PLE_MMAP_HOIST_CHECK")
_ENGINE = ("the PLE engine's {}: the gather runs outside the traced graph (an eager break on "
           "0.30+, the vllm::flash_ple_mmap_lookup splitting op on 0.29)")
UNTRACED = {
    ENV: UNTRACED_GATE,
    "VLLM_PLE_MMAP_DIR": _ENGINE.format("source directory (a path)"),
    "VLLM_PLE_MMAP_WORKERS": _ENGINE.format("thread pool size"),
    "VLLM_PLE_MMAP_PREWARM": _ENGINE.format("page-cache prewarm"),
    "VLLM_PLE_MMAP_MADVISE": _ENGINE.format("madvise advice"),
    "VLLM_PLE_MMAP_FAST_ROWS": _ENGINE.format("inline-read threshold"),
    "VLLM_PLE_MMAP_STATS_SEC": _ENGINE.format("stats log interval"),
    "VLLM_PLE_MMAP_PROMETHEUS": _ENGINE.format("Prometheus export"),
    "VLLM_PLE_MMAP_RING_DEPTH": _ENGINE.format("io_uring depth"),
    "VLLM_PLE_MMAP_CHUNK": _ENGINE.format("rows per pool task"),
    "VLLM_PLE_MMAP_IO": _ENGINE.format("I/O method"),
    "VLLM_PLE_MMAP_NATIVE": _ENGINE.format("compiled (numba) gather loops"),
    "VLLM_PLE_MMAP_DEDUP_MIN": _ENGINE.format("Stager dedup threshold (its own small CUDA graphs are "
                                              "captured by the Stager, not by torch.compile)"),
}


def knobs(env) -> dict:
    """mode: eager gathers inside the forward, hoisted before it (0.30+); debug swaps in the
    cross-checking forward; hoist_check adds the id comparison to the hoisted forward."""
    from ...ple.config import config_from_env

    cfg = config_from_env(env)
    return {"mode": cfg.mode, "debug": cfg.debug, "hoist_check": cfg.hoist_check}


def make_storage(upstream_cls):
    """A subclass of the release's `Qwen4ExpPLEEmbedding` serving rows from the mmapped table.

    `upstream_cls` is the class it replaces (pinned-host or device); its base provides ETP/DP
    helpers, `weight_loader` and the quant-method plumbing.
    """
    import torch
    from vllm.config import get_current_vllm_config

    Qwen4ExpPLEEmbedding = storage_base(upstream_cls)

    class FlashMmapPLEEmbedding(Qwen4ExpPLEEmbedding):
        """PLE rows read from the checkpoint's mmapped shards by flash's PLE engine (patch 1)."""

        supports_prefetch = False

        def __init__(self, num_embeddings, embedding_dim, *, params_dtype, prefix, num_ngram_heads=1,
                     max_total_tokens=0, **kwargs):
            # kwargs: padding_size, embedding_method, data_parallel_rank (+ reduce_results on 0.32+)
            super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype, prefix=prefix,
                             num_ngram_heads=num_ngram_heads, max_total_tokens=max_total_tokens, **kwargs)
            if self.tp_size != 1:
                raise ValueError(f"VLLM_PLE_MMAP serves the whole table per process; ETP size "
                                 f"{self.tp_size} is not supported (use 1)")
            vcfg = get_current_vllm_config()
            self._flash_model_path = getattr(getattr(vcfg, "model_config", None), "model", None)
            self._flash_layer = layer_of(prefix)
            self._flash_rows = max(int(max_total_tokens), 1)
            self._flash_heads = int(num_ngram_heads)
            self._flash_out_dtype = params_dtype
            self._flash_out = None
            self._flash_stager = None
            self._flash_gather = eager_break(self._gather_into)
            self._flash_hoist = _hoist().slot_for_new_storage()  # hoisted mode: the runner gathers

        def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype):
            # Shape and dtype for the loaders' checks; no storage anywhere.
            return torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="meta")

        def weight_loader(self, param, loaded_weight, checkpoint_start=None):
            # Per-row tensors were allocated through us on meta (the rows, and NVFP4's block
            # scales): served from disk. Per-tensor scales are real parameters and load as stock.
            if param is self.weight or param.is_meta:
                return
            return super().weight_loader(param, loaded_weight, checkpoint_start=checkpoint_start)

        def dequantize(self, embeddings, output_dtype):
            return embeddings.to(output_dtype)  # the Stager already applied the table scale(s)

        def stager(self, device):
            if self._flash_stager is None:
                from ...ple import Stager

                table = TABLES.get(self._flash_model_path, self._flash_layer)
                if table.num_rows < self.org_vocab_size:
                    raise ValueError(f"PLE table of layer {self._flash_layer} has {table.num_rows} rows; "
                                     f"the model expects {self.org_vocab_size}")
                if table.head_dim != self.embedding_dim:
                    raise ValueError(f"PLE table of layer {self._flash_layer} has rows of {table.head_dim} values; "
                                     f"the model expects {self.embedding_dim}")
                # The release's method decides what it loaded (weight_scale_2, or a weight_scale):
                # a table on disk in another format than the method read would decode wrong.
                nvfp4_method = type(self.embedding_method).__name__ == "Qwen4ExpPLENvFp4EmbeddingMethod"
                if (table.dtype == "NVFP4") != nvfp4_method:
                    raise ValueError(
                        f"PLE table of layer {self._flash_layer} is {table.dtype} on disk but vLLM chose "
                        f"{type(self.embedding_method).__name__} for it"
                        + ("" if nvfp4_method else ": an NVFP4 table needs the release's NVFP4 table method "
                           "(vLLM 0.33+) and a quantization_config that names the table NVFP4"))
                self._flash_stager = Stager(table, device, out_dtype=self._flash_out_dtype,
                                            stats=TABLES.stats)
            return self._flash_stager

        def _gather_into(self, ngram_ids, out):
            gather_into(self.stager, ngram_ids, out)

        def start_prefetch(self, *args):  # (ngram_ids) on 0.32+, (hidden_states, ngram_ids) before
            return None

        def finalize_prefetch(self, total_tokens):
            raise RuntimeError("mmap PLE embedding does not prefetch")

        def _flash_buffer(self, n, heads_shape, device):
            """The persistent output buffer (>= n rows), allocated outside any capture."""
            out = self._flash_out
            if out is None or out.shape[0] < n or out.device != device:
                if _is_capturing(torch):
                    raise RuntimeError("mmap PLE output buffer must be allocated before graph capture")
                out = torch.zeros(max(self._flash_rows, n), *heads_shape, self.embedding_dim,
                                  dtype=self._flash_out_dtype, device=device)
                self._flash_out = out
            return out

        def forward(self, ngram_ids):
            if self._flash_hoist is not None:  # filled before the forward by the runner's hook
                return self._flash_hoist.read(self, ngram_ids)
            n = ngram_ids.shape[0]
            view = self._flash_buffer(n, ngram_ids.shape[1:], ngram_ids.device)[:n]
            self._flash_gather(ngram_ids, view)
            return view

    FlashMmapPLEEmbedding.__name__ = FlashMmapPLEEmbedding.__qualname__ = f"FlashMmap{upstream_cls.__name__}"
    FlashMmapPLEEmbedding.__doc__ = f"{FlashMmapPLEEmbedding.__doc__} Replaces {upstream_cls.__name__}."
    return FlashMmapPLEEmbedding


def storage_base(upstream_cls):
    """The release's abstract `Qwen4ExpPLEEmbedding` (nvidia/ on 0.30, common/ on 0.31+)."""
    for c in original(upstream_cls).__mro__:
        if c.__name__ == "Qwen4ExpPLEEmbedding":
            return c
    raise TargetMissing(f"{upstream_cls.__name__} no longer derives from Qwen4ExpPLEEmbedding")


def _hoist():
    from . import hoist

    return hoist


def _v029():
    from . import v029

    return v029


def check(ctx: Context) -> None:
    flavour = FLAVOURS.get(ctx.base.name)
    if flavour is None:
        raise TargetMissing(f"patch 1 ships no code for {ctx.base.name}: {PATCH.not_ported.get(ctx.base.name)}")
    if flavour == "splitting-op":
        return _v029().check()
    expect_source(*INIT, "Qwen4ExpPLEPinnedHostEmbedding", "Qwen4ExpPLEDeviceEmbedding",
                  "engram_config.cpu_offload", "embedding_cls(", "max_total_tokens=max_total_tokens")
    expect_source(*FORWARD, "embedding.supports_prefetch", "embedding(ngram_ids).flatten(-2)")
    expect_source(*LOAD, "weight_loader(", "checkpoint_start=checkpoint_start")
    _, _, pinned = resolve(*PINNED)
    _, _, device = resolve(*DEVICE)
    base = storage_base(pinned)
    if storage_base(device) is not base:
        raise TargetMissing("the pinned-host and device PLE classes no longer share Qwen4ExpPLEEmbedding")
    for name in ("allocate_embedding_weight", "dequantize", "weight_loader", "start_prefetch"):
        if not hasattr(base, name):
            raise TargetMissing(f"Qwen4ExpPLEEmbedding has no {name}")
    if "pin_memory=True" not in inspect.getsource(original(pinned).allocate_embedding_weight):
        raise TargetMissing(f"{NGRAM}:Qwen4ExpPLEPinnedHostEmbedding no longer pins its weight")
    expect_source("vllm.compilation.breakable_cudagraph", "eager_break_during_capture",
                  "cudagraph_runtime_mode")
    if _hoist().wanted(ctx):
        _hoist().check(ctx)


def apply(ctx: Context) -> None:
    hoisted = _hoist().wanted(ctx)  # warns (once) where the hoisted mode is asked for but not served
    if FLAVOURS[ctx.base.name] == "splitting-op":
        return _v029().apply()
    install(NUMBER, *PINNED, make_storage)
    install(NUMBER, *DEVICE, make_storage)
    if hoisted:
        _hoist().apply(ctx)
    if ctx.flag("VLLM_PLE_MMAP_DEBUG"):
        from .debug import make_forward

        install(NUMBER, *FORWARD, make_forward)


def verify(ctx: Context) -> None:
    if FLAVOURS[ctx.base.name] == "splitting-op":
        return _v029().verify()
    expect_installed(NUMBER, *PINNED)
    expect_installed(NUMBER, *DEVICE)
    if _hoist().wanted(ctx):
        _hoist().verify(ctx)


PATCH = Patch(
    number=NUMBER,
    name="ple-mmap",
    title="PLE n-gram table served from the mmapped checkpoint (never on the GPU, never pinned)",
    why=("The 47.68 GiB PLE table is allocated on the GPU or (0.33 default, cpu_offload) pinned in "
         "host RAM; on GB10 unified memory both cost the whole table. The storage class is "
         "replaced by one with a meta weight that skips the shard rows at load and reads rows from "
         "the checkpoint shards through the PLE engine into a persistent buffer (FP8/BF16 rows; on "
         "0.33 also ModelOpt NVFP4 tables, 90 B a row, decoded on the GPU): as an eager break "
         "on 0.30+, inside a splitting op of ours (vllm::flash_ple_mmap_lookup, appended to "
         "CompilationConfig._attention_ops) on 0.29, where the release's own layer still applies "
         "the fp8 scale. The eager gather ships with cudagraph_mode=PIECEWISE (FULL decode graphs would "
         "capture it). VLLM_PLE_MMAP_MODE=hoisted (0.30-0.33, the recipe's default there) gathers the step's "
         "rows before the forward, from Qwen4ExpModelState.prepare_inputs, so FULL decode graphs are legal."),
    upstream="vllm#54129 (VLLM_PLE_MMAP, open) / vllm#54070 (disk-backed tables, open)",
    gate=Gate.flag(ENV),
    targets=tuple(f"{m}:{q}" for m, q in (PINNED, DEVICE, INIT, FORWARD, LOAD) + V029_TARGETS + HOIST_TARGETS),
    applies_to=frozenset(FLAVOURS),
    not_ported={b: "no port of patch 1 to this release (catalogue: ple_storage=None)"
                for b in releases.where("ple_storage", None)},
    check=check, apply=apply, verify=verify,
    traced=TRACED, knobs=knobs, untraced=UNTRACED,
    notes="Graph regime: hoisted mode (env VLLM_PLE_MMAP_MODE=hoisted; served on " + ", ".join(sorted(HOIST_BASES))
          + " only, hoist.BASES; the recipe's PLE_MODE=auto picks it there): FULL_AND_PIECEWISE. Eager mode "
          "(the plugin's default when the env is unset; auto's on the other bases; PLE_MODE=eager): the run spec "
          "forces cudagraph_mode=PIECEWISE (and leaves splitting_ops unset, so 0.29 copies its list with our "
          "op). An explicit PLE_MODE=hoisted where not served is refused by preflight (the plugin stays eager).",
)
