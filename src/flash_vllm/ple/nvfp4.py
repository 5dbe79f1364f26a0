"""The NVFP4 PLE table (ModelOpt's QAD export): rows gathered on the host, decoded on the device.

Storage (per shard k; `discovery.find_nvfp4`): `shard_k.weight` U8 [rows, w/2] (two E2M1 codes a
byte, the low nibble the even element), `shard_k.weight_scale` F8_E4M3 [rows, w/16] (one scale per
16 values) and one F32 `weight_scale_2`. A row of the real table (w = 160) is 80 code bytes + 10
scale bytes = **90 B** gathered and copied to the device, against 320 B for a BF16/F16 row (0.28x)
and 160 B for the FP8 one (0.56x); the table is 26.8 GiB on disk instead of 95.4 / 47.7 GiB.

`NvFp4Table` is the host half: two `PLETable`s over the same row ids (codes, block scales; each
with its own mapping, so the two tensors may sit in different files) whose gathers are laid side
by side, so a gathered row is its 90 bytes (codes then scales) and everything downstream (the
Stager's pinned slots, dedup, inverse expansion on the device) keeps working on byte rows.

`Decoder` is the device half (torch, imported lazily; `Stager` uses it for tables of dtype
"NVFP4"): value = (E2M1(code) x E4M3(scale)) x weight_scale_2 in float32, then the conversion to
the model's dtype. That is the operation order of vLLM 0.33's own CUDA lookup
(`_lookup_nvfp4_ple_embedding_kernel`: `e2m1 * scales * global_scale`, stored in the output dtype):
the product of an E2M1 and an E4M3 value is exact in float32, so two roundings follow, the same
two as vLLM's (x g in float32, then to bf16): the same bits, not a correctly rounded v*s*g. A NaN block scale (E4M3 0x7F/0xFF) makes its 16 values NaN, zero codes included,
as there; an infinite or NaN `weight_scale_2` propagates the same way (0 x inf = NaN).
"""

from __future__ import annotations

import time

from .discovery import NVFP4_BLOCK, PLETableError, find_nvfp4, table_format

# E2M1 magnitudes of codes 0..7 (1 sign bit, 2 exponent bits, 1 mantissa bit); bit 3 is the sign
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class NvFp4Table:
    """Read-only NVFP4 table: ``num_rows`` rows of ``row_bytes`` = codes + block scales.

    The gather API is `PLETable`'s (`gather`, `gather_into`, `gather_unique`, `prefetch`, ...):
    row i of a result is ``code_bytes`` code bytes followed by ``scale_bytes`` scale bytes."""

    dtype = "NVFP4"
    scale = None  # no per-tensor scale to multiply by; the Decoder applies the block and global ones

    def __init__(self, codes, scales, width: int, global_scale: float, config=None, stats=None,
                 expected_rows: int | None = None, prefix: str = "", buffers=None):
        import numpy as np

        from .config import PLEConfig
        from .table import PLETable

        self._np = np
        self.config = config or PLEConfig()
        self.stats = stats
        self.prefix = prefix
        self.buffers = buffers or {}
        if width % NVFP4_BLOCK:
            raise PLETableError(f"NVFP4 rows of {width} values: not a whole number of {NVFP4_BLOCK}-value blocks")
        self.head_dim = int(width)
        self.code_bytes, self.scale_bytes = width // 2, width // NVFP4_BLOCK
        self.row_bytes = self.code_bytes + self.scale_bytes
        self.global_scale = float(global_scale)
        # the halves record nothing: one gather of this table is one row batch in the stats
        self.codes = PLETable(codes, "U8", self.code_bytes, config=self.config, expected_rows=expected_rows)
        try:
            self.scales = PLETable(scales, "U8", self.scale_bytes, config=self.config, expected_rows=expected_rows)
        except Exception:
            self.codes.close()
            raise
        if (self.scales.num_rows, self.scales.rows_per_shard) != (self.codes.num_rows, self.codes.rows_per_shard):
            self.close()
            raise PLETableError(f"NVFP4 block scales cover {self.scales.num_rows} rows, the codes {self.codes.num_rows}")
        self.num_rows = self.codes.num_rows
        self.rows_per_shard = self.codes.rows_per_shard
        self.num_shards = self.codes.num_shards
        self.io = self.codes.io
        self._cbuf = np.empty((0, self.code_bytes), np.uint8)
        self._sbuf = np.empty((0, self.scale_bytes), np.uint8)
        self.last_strategy = ""

    @classmethod
    def from_checkpoint(cls, model_dir, layer: int | None = None, config=None, stats=None,
                        expected_rows: int | None = None) -> "NvFp4Table":
        import os

        prefix, codes, scales, width, g, buffers = find_nvfp4(os.fspath(model_dir), layer)
        return cls(codes, scales, width, g, config=config, stats=stats, expected_rows=expected_rows,
                   prefix=prefix, buffers=buffers)

    def describe(self) -> str:
        gib = self.num_rows * self.row_bytes / 2**30
        return (f"PLE mmap: NVFP4, {self.num_shards} shards, {self.num_rows} rows x {self.row_bytes} B "
                f"({self.code_bytes} code + {self.scale_bytes} scale bytes; {gib:.2f} GiB on disk), "
                f"{self.head_dim} values a row, weight_scale_2 {self.global_scale!r}, decoded on the device; "
                f"codes: {self.codes.describe().removeprefix('PLE mmap: ')}")

    # -- gathers -------------------------------------------------------------------------------
    def _scratch(self, n: int):
        if self._cbuf.shape[0] < n:  # grown, never shrunk: decode batches reuse it without allocating
            cap = max(n, 64, int(self._cbuf.shape[0] * 1.5))
            self._cbuf = self._np.empty((cap, self.code_bytes), self._np.uint8)
            self._sbuf = self._np.empty((cap, self.scale_bytes), self._np.uint8)
        return self._cbuf[:n], self._sbuf[:n]

    def gather_into(self, flat, out, t0=None):
        """``flat`` C-contiguous int64 (n,) -> ``out`` C-contiguous uint8 (n, row_bytes)."""
        if t0 is None:
            t0 = time.perf_counter()
        n = flat.shape[0]
        c, s = self._scratch(n)
        self.codes.gather_into(flat, c)  # range-checked there (IndexError naming the id)
        self.scales.gather_into(flat, s)
        out[:, : self.code_bytes] = c
        out[:, self.code_bytes:] = s
        self.last_strategy = self.codes.last_strategy
        self._record(t0, 0.0, n)
        return out

    def gather(self, ids, out=None):
        """Rows of ``ids`` (any int array, flattened) as uint8 ``(ids.size, row_bytes)``; big
        batches read each distinct row once and expand on the host."""
        np = self._np
        t0 = time.perf_counter()
        flat = self._flat(ids)
        n = flat.shape[0]
        if out is None:
            out = np.empty((n, self.row_bytes), dtype=np.uint8)
        elif out.shape != (n, self.row_bytes) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous uint8 {(n, self.row_bytes)}, got {out.dtype} {out.shape}")
        if n <= 4096 or (self.config.fast_rows and n <= self.config.fast_rows):
            return self.gather_into(flat, out, t0)
        rows, inv = self.gather_unique(flat)
        np.take(rows, inv, axis=0, out=out)
        return out

    def gather_unique(self, ids, out=None):
        """``(rows of np.unique(ids), inverse)``: what the stager uploads and expands on the device."""
        np = self._np
        flat = self._flat(ids)
        self.codes._check(flat)
        uniq, inv = np.unique(flat, return_inverse=True)
        k = uniq.shape[0]
        out = np.empty((k, self.row_bytes), dtype=np.uint8) if out is None else out[:k]
        self.gather_into(uniq, out)
        return out, inv.reshape(-1)

    def _record(self, t0, dedup_s, rows):
        if self.stats is not None:
            self.stats.record(gather_s=time.perf_counter() - t0 - dedup_s, dedup_s=dedup_s, rows=rows,
                              bytes=rows * self.row_bytes)

    @staticmethod
    def _flat(ids):
        from .table import PLETable

        return PLETable._flat(ids)

    def prefetch(self, ids) -> None:
        self.codes.prefetch(ids)
        self.scales.prefetch(ids)

    def prewarm(self) -> None:
        self.codes.prewarm()
        self.scales.prewarm()

    def drop_cache(self) -> None:
        self.codes.drop_cache()
        self.scales.drop_cache()

    def close(self) -> None:
        for half in ("codes", "scales"):
            t = self.__dict__.pop(half, None)
            if t is not None:
                t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Decoder:
    """Gathered NVFP4 byte rows (on the device) -> float32 values, see the module doc."""

    def __init__(self, device, code_bytes: int, global_scale: float):
        import torch

        mag = torch.tensor(E2M1, dtype=torch.float32)
        nibble = torch.cat([mag, -mag])  # codes 0..15; code 8 is -0.0, as vLLM decodes it
        b = torch.arange(256)
        # a byte -> its two values, low nibble first (the even element): one lookup per code byte
        self.pairs = torch.stack([nibble[b & 15], nibble[b >> 4]], dim=1).to(device)
        # E4M3FN bytes -> float32 by torch's own conversion (0x7F/0xFF NaN, subnormals exact)
        self.e4m3 = b.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).to(device)
        self.g = torch.tensor(float(global_scale), dtype=torch.float32, device=device)
        self.code_bytes = int(code_bytes)
        self.blocks = self.code_bytes * 2 // NVFP4_BLOCK

    def decode(self, rows):
        """``rows`` uint8 (n, code_bytes + blocks) -> float32 (n, 2 * code_bytes). Only device ops
        with fixed shapes (capturable in the Stager's CUDA graphs)."""
        n, cb = rows.shape[0], self.code_bytes
        v = self.pairs.index_select(0, rows[:, :cb].long().reshape(-1)).view(n, self.blocks, NVFP4_BLOCK)
        s = self.e4m3.index_select(0, rows[:, cb:].long().reshape(-1)).view(n, self.blocks, 1)
        return v.mul_(s).mul_(self.g).view(n, 2 * cb)  # (v x s) exact; x g rounds in float32, as vLLM's kernel


def open_table(model_dir, layer: int | None = None, config=None, stats=None, expected_rows: int | None = None):
    """The checkpoint's PLE table in whichever format it has: `NvFp4Table` or `PLETable`."""
    import os

    from .table import PLETable

    d = os.fspath(model_dir)
    cls = NvFp4Table if table_format(d, layer) == "nvfp4" else PLETable
    return cls.from_checkpoint(d, layer=layer, config=config, stats=stats, expected_rows=expected_rows)
