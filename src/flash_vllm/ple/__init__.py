"""PLE engine: serve Qwen3.8-Flash-Next's 47.68 GiB n-gram (PLE) table from the checkpoint on disk.

Importable without vLLM and without torch: numpy is imported by the modules that need it, torch
only by the GPU stager. The vLLM integration (plugin patch 1, ``flash_vllm/patches/p01_ple_mmap/``) calls this.

Public API (the contract patch 1 codes against)
-----------------------------------------------
Configuration (``config.py``)::

    cfg = config_from_env(os.environ)       # -> PLEConfig; raises PLEConfigError(ValueError) naming
                                            #    the variable, the bad value and what is accepted
    cfg.enabled        # VLLM_PLE_MMAP in {1,true,yes} (0/false/no/"" -> False)
    cfg.workers        # VLLM_PLE_MMAP_WORKERS, int >= 1, default 32
    cfg.prewarm        # VLLM_PLE_MMAP_PREWARM 0/1, default 0
    cfg.madvise        # VLLM_PLE_MMAP_MADVISE "random" (default) | "normal"
    cfg.fast_rows      # VLLM_PLE_MMAP_FAST_ROWS int >= 0, 0 = the strategy picks (default)
    cfg.stats_sec      # VLLM_PLE_MMAP_STATS_SEC float, default 30, <= 0 disables the log line
    cfg.prometheus     # VLLM_PLE_MMAP_PROMETHEUS 0/1, default 1
    cfg.source_dir     # VLLM_PLE_MMAP_DIR or None (then the model path)
    cfg.io             # VLLM_PLE_MMAP_IO auto (timed choice) | uring | mmap (never io_uring)
    cfg.ring_depth, cfg.chunk   # VLLM_PLE_MMAP_RING_DEPTH (256), VLLM_PLE_MMAP_CHUNK (2048)

Hashing (``hashing.py``, numpy, bit-identical to transformers' qwen4_exp)::

    layout = PLELayout.from_config(text_config)   # dict or object with the qwen4_exp fields
    layout.head_sizes / .head_offsets / .multipliers / .num_rows / .rows_per_shard / .eos
    ids = ngram_ids(tokens, layout, context=None)  # tokens: int array (T,), context: the last
                                                   #   ngram_size-1 ids before them (None = EOS)
                                                   # -> int64 (T, 16) global row ids
    ids = ngram_ids_batch(tokens, query_start_loc, layout, contexts=None)
                                                   # flat tokens of many requests; contexts (R, 2)
    layout.check_buffers(**table.buffers)        # vs the checkpoint's I64 buffers (ValueError)

Table (``table.py``)::

    table = PLETable.from_checkpoint(model_dir, layer=1, config=cfg, stats=None)
        # shards via model.safetensors.index.json (any file layout), dtype + scale from headers,
        # partial last shard, MADV_RANDOM (cfg.madvise), optional prewarm; raises PLETableError
    table.num_rows, table.row_bytes, table.head_dim, table.dtype ("F8_E4M3"|"F8_E5M2"|"BF16"|"F16"),
    table.scale (float or None), table.rows_per_shard, table.buffers (the I64 buffers), table.describe()
    rows = table.gather(ids, out=None)  # any int array -> uint8 (ids.size, row_bytes), row i =
                                        # bytes of table[ids.flat[i]]; IndexError if out of range;
                                        # out= a preallocated C-contiguous uint8 array (pinned view)
    urows, inverse = table.gather_unique(ids)   # rows of np.unique(ids) + inverse (for staging)
    table.prefetch(ids)                 # hint only (WILLNEED), returns at once
    table.last_strategy                 # uring | take | willneed | pool (see table.py docstring)
    table.close()

    table = open_table(model_dir, layer=1, config=cfg, stats=None)
        # the table in whichever format the checkpoint has: PLETable (row tables above) or
        # NvFp4Table (nvfp4.py: ModelOpt NVFP4, U8 codes + E4M3 block scales + F32 weight_scale_2;
        # same gather API, rows of 90 B = 80 code + 10 scale bytes, dtype "NVFP4", scale None,
        # .global_scale; the Stager decodes them on the device, never raw)

GPU staging (``stager.py``, torch; also runs on CPU torch)::

    stager = Stager(table, device, out_dtype=torch.bfloat16, max_rows=8192, stats=stats)  # dedup_min=None:
                                        # the table's config (VLLM_PLE_MMAP_DEDUP_MIN, default 1025)
    emb = stager.lookup(ids)            # ids: np/torch int array (*S) -> tensor (*S, head_dim) on
                                        # device, dequantized (fp8 x scale) to out_dtype; raw=True
                                        # gives the table dtype. Persistent pinned buffers (2 slots),
                                        # async H2D, GPU-side expansion via the inverse (batches >=
                                        # dedup_min), CUDA-event reuse guard (no device-wide sync).
    stager.lookup(ids, out=buf)         # fills a caller-provided (persistent) device tensor
    # lookup() does host work (the gather) and replays its own small CUDA graphs: call it before
    # the forward or in an eager break (never inside a vLLM graph capture). Batches <= 1024 rows
    # replay one graph per (slot, rows, out buffer): keep `out` persistent so graphs are reused.

Observability (``stats.py``)::

    stats = PLEStats(stats_sec=cfg.stats_sec, prometheus=cfg.prometheus)  # vllm:ple_mmap_* counters
    stats.record(ops=1, op_s=...) ; stats.maybe_log() ; stats.line() -> str ; stats.snapshot() -> dict
    # pass the same object to PLETable(stats=) and Stager(stats=); both record, never raise

Synthetic checkpoints (``synth.py``, tests/bench): ``write_checkpoint(dir, layout="radixark"|"nvidia", ...)``.
io_uring (``uring.py``): ``Ring(depth).read_batch(fds, offsets, addrs, lengths)``.

Safetensors headers (``flash_common.stheader``, re-exported): ``read_header``, ``read_index``, ``HeaderError``.
"""

from __future__ import annotations

from flash_common.stheader import Header, HeaderError, TensorInfo, read_header, read_index

# Lazy re-exports: `import flash_vllm.ple` stays free of numpy/torch until a name is used.
_LAZY = {
    "PLEConfig": "config", "PLEConfigError": "config", "config_from_env": "config",
    "PLELayout": "hashing", "ngram_ids": "hashing", "ngram_ids_batch": "hashing",
    "PLETable": "table", "PLETableError": "table",
    "NvFp4Table": "nvfp4", "open_table": "nvfp4",
    "Stager": "stager",
    "PLEStats": "stats",
}

__all__ = ["Header", "HeaderError", "TensorInfo", "read_header", "read_index", *_LAZY]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'flash_vllm.ple' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
