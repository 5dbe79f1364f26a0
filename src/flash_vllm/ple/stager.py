"""Stage gathered PLE rows to the GPU: pinned buffers, async H2D, GPU-side expansion, fp8 dequant.

Per lookup:
1. ids to host int64 (numpy, or a CPU tensor; a CUDA tensor costs a blocking D2H, timed as gpu-wait).
2. Pick the next of two pinned slots; wait on that slot's CUDA event — only the H2D copy issued
   from it two lookups ago, never a device-wide sync (timed as gpu-wait).
3. Gather straight into the pinned slot: distinct rows only when the batch is big enough for dedup
   to pay (``dedup_min``), with the inverse index written next to them.
4. One non-blocking H2D of the rows (+ the inverse), record the slot's event on the current stream.
5. On the device: expand through the inverse (``index_select``), view the bytes as the table dtype,
   dequantize (fp8/bf16/f16 -> ``out_dtype``, times the table scale; fp8 and bf16 values are exact in
   f32, so ``to(out_dtype).mul_(scale)`` equals ``(x.f32 * scale).to(out_dtype)``). NVFP4 tables
   (``nvfp4.NvFp4Table``, 90-byte rows of codes + block scales) are decoded by ``nvfp4.Decoder``
   instead (float32, then one rounding to ``out_dtype``); they have no raw view.

Runs on CPU torch too (no pinning, no events, a real copy instead of the H2D), which is how the unit
tests exercise it; ``tests/gpu/`` checks it bit-exact on a GPU.
"""

from __future__ import annotations

import time

_TORCH_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "BF16": "bfloat16", "F16": "float16",
                 "F32": "float32"}


def torch_dtype(name: str):
    import torch

    return getattr(torch, _TORCH_DTYPES[name])


class Stager:
    def __init__(self, table, device="cuda", out_dtype=None, max_rows: int = 8192, dedup_min: int | None = None,
                 stats=None, slots: int = 2, graph_max_rows: int | None = None, max_graphs: int = 160,
                 zero_copy: bool | None = None):
        import numpy as np
        import torch

        from .config import GRAPH_MAX_ROWS, PLEConfig

        self.torch, self.np = torch, np
        self.table = table
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._nvfp4 = None
        if table.dtype == "NVFP4":
            from .nvfp4 import Decoder

            self._nvfp4 = Decoder(self.device, table.code_bytes, table.global_scale)
            self.table_dtype = torch.uint8  # the rows stay bytes until decoded
        else:
            self.table_dtype = torch_dtype(table.dtype)
        self.out_dtype = out_dtype if out_dtype is not None else torch.bfloat16
        self.scale = table.scale
        if dedup_min is None:  # the table's settings (VLLM_PLE_MMAP_DEDUP_MIN); PLEConfig's default without
            dedup_min = getattr(table, "config", PLEConfig()).dedup_min
        self.dedup_min = dedup_min
        self.stats = stats
        # a graph per (slot, rows, raw, out): decode and short prefills below the limit are up to 64
        # token counts x 16 heads, x 2 slots; fewer graphs than that would recapture in a cycle
        self.max_graphs = max_graphs
        self.n_slots = max(1, slots)
        self.capacity = 0
        self._slot = 0
        # Small batches on CUDA: the device part (H2D + view + dequant) replays as one CUDA graph
        # per (slot, rows, raw, out buffer): one launch instead of 3-4 ops and their allocations.
        self.graph_max_rows = (GRAPH_MAX_ROWS if graph_max_rows is None else graph_max_rows) if self.cuda else 0
        self._graph_events = None  # captured graphs record the slot's event themselves (torch >= 2.8)
        # zero_copy: the captured kernel reads the pinned slot over the bus (a pinned buffer's host
        # address is valid on the device under UVA) instead of a separate H2D copy node: one node
        # less per lookup. None = where the device alias can be made.
        self.zero_copy = self.cuda and zero_copy is not False
        self.zero_copy_note = ""
        self._graphs: dict = {}
        try:
            self._alloc(max_rows)
        except (RuntimeError, TypeError, ValueError) as e:
            if zero_copy or not self.zero_copy:
                raise
            self.zero_copy, self.zero_copy_note = False, f"zero copy unavailable ({e})"
            self._alloc(max_rows)

    def _alloc(self, rows: int) -> None:
        torch = self.torch
        for ev in getattr(self, "_events", []):  # never free a buffer a copy may still read
            if ev is not None:
                ev.synchronize()
        pin = self.cuda
        rb = self.table.row_bytes
        self._rows = [torch.empty((rows, rb), dtype=torch.uint8, pin_memory=pin) for _ in range(self.n_slots)]
        self._inv = [torch.empty((rows,), dtype=torch.int64, pin_memory=pin) for _ in range(self.n_slots)]
        self._rows_np = [t.numpy() for t in self._rows]
        self._inv_np = [t.numpy() for t in self._inv]
        self._uva = [self._device_alias(t) for t in self._rows] if self.zero_copy else None
        self._events = [None] * self.n_slots
        self._graphs = {}  # captured graphs read the old buffers
        self.capacity = rows

    def _device_alias(self, pinned):
        """A CUDA tensor over the same (pinned, UVA-mapped) bytes as ``pinned``."""
        torch = self.torch

        class _CAI:
            __cuda_array_interface__ = {"shape": tuple(pinned.shape), "typestr": "|u1",
                                        "data": (pinned.data_ptr(), False), "version": 2, "strides": None}

        t = torch.as_tensor(_CAI(), device=self.device)
        if t.data_ptr() != pinned.data_ptr():
            raise RuntimeError("pinned memory is not mapped at the same address on the device")
        return t

    def _host_ids(self, ids):
        """-> (flat int64 numpy, shape, seconds waited for the GPU)."""
        torch, np = self.torch, self.np
        if isinstance(ids, torch.Tensor):
            shape = tuple(ids.shape)
            if ids.device.type != "cpu":
                t0 = time.perf_counter()
                ids = ids.to("cpu")  # blocking: waits for the kernels that produce the ids
                return ids.numpy().reshape(-1).astype(np.int64, copy=False), shape, time.perf_counter() - t0
            return ids.numpy().reshape(-1).astype(np.int64, copy=False), shape, 0.0
        a = np.asarray(ids)
        return a.reshape(-1).astype(np.int64, copy=False), a.shape, 0.0

    def lookup(self, ids, raw: bool = False, out=None):
        """Embeddings ``(*ids.shape, head_dim)`` on the device: ``out_dtype`` dequantized, or the
        table dtype when ``raw``. ``out`` (a device tensor of that shape and dtype) is filled in place.

        Small batches (< ``dedup_min`` rows, <= ``graph_max_rows``) take the short path: the gather
        is one compiled call into the pinned slot (``table.gather_into``), the device part one
        CUDA-graph replay, then one event record; no allocation when ``out`` is given."""
        t0 = time.perf_counter()
        if type(ids) is self.np.ndarray and ids.dtype == self.np.int64 and ids.flags.c_contiguous:
            flat, shape, wait_s = ids.reshape(-1), ids.shape, 0.0
        else:
            flat, shape, wait_s = self._host_ids(ids)
        n = flat.shape[0]
        if 0 < n < self.dedup_min and n <= self.graph_max_rows and n <= self.capacity:
            if not flat.flags.c_contiguous:
                flat = self.np.ascontiguousarray(flat)
            s = self._slot
            self._slot = (s + 1) % self.n_slots
            ev = self._events[s]
            if ev is not None:
                tw = time.perf_counter()
                ev.synchronize()  # only the copy that last read this slot, never the whole device
                wait_s += time.perf_counter() - tw
            self.table.gather_into(flat, self._rows_np[s][:n])
            ts = time.perf_counter()
            emb = self._replay(s, n, raw, out)
            if out is None:
                emb = emb.clone().view(*shape, self.table.head_dim)  # the graph's output is static
            if self.stats is not None:
                t1 = time.perf_counter()
                self.stats.record(ops=1, op_s=t1 - t0, gpu_wait_s=wait_s, stage_s=t1 - ts)
                self.stats.maybe_log()
            return emb if out is None else out
        return self._lookup(flat, shape, wait_s, raw, out)

    def _values(self, rows, raw, out=None):
        """Device byte rows (n, row_bytes) -> the table dtype (raw) or ``out_dtype`` values, into
        ``out`` when given (a (n, head_dim) device tensor)."""
        if self._nvfp4 is not None:
            if raw:
                raise ValueError("an NVFP4 PLE table has no raw row dtype: its rows are decoded (raw=False)")
            f32 = self._nvfp4.decode(rows)
            if out is not None:
                return out.copy_(f32)  # one rounding f32 -> out.dtype, as to() does
            return f32.to(self.out_dtype)
        emb = rows.view(self.table_dtype)
        if out is not None:
            # Straight into the caller's buffer: copy_ converts exactly like to(out_dtype), and the
            # in-place mul rounds like the eager path's (two kernels instead of three).
            out.copy_(emb)
            if not raw and self.scale is not None:
                out.mul_(self.scale)
            return out
        if not raw:
            emb = emb.to(self.out_dtype)
            if self.scale is not None:
                emb.mul_(self.scale)
        return emb

    def _device_part(self, src, dev_u8, raw, out=None):
        if dev_u8 is None:  # zero copy: src is the pinned slot's device alias
            return self._values(src, raw, out)
        dev_u8.copy_(src, non_blocking=True)
        return self._values(dev_u8, raw, out)

    def _replay(self, s, n, raw, out):
        torch = self.torch
        key = (s, n, raw, None if out is None else (out.data_ptr(), out.dtype))
        g = self._graphs.get(key)
        if g is None:
            if len(self._graphs) >= self.max_graphs:
                self._graphs.pop(next(iter(self._graphs)))
            if self.zero_copy:
                src, dev_u8 = self._uva[s][:n], None
            else:
                src = self._rows[s][:n]
                dev_u8 = torch.empty((n, self.table.row_bytes), dtype=torch.uint8, device=self.device)
            outv = None if out is None else out.view(n, self.table.head_dim)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm up outside the capture (allocator, kernels)
                self._device_part(src, dev_u8, raw, outv)
            torch.cuda.current_stream(self.device).wait_stream(side)
            ev = self._event(s)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    res = self._device_part(src, dev_u8, raw, outv)
                    if self._graph_events:
                        # An event-record node: the replay itself marks the slot read, no host call
                        # (a plain Event.record() costs ~9 µs of Python + driver per lookup).
                        ev.record()
            except RuntimeError:
                if not self._graph_events:
                    raise
                self._graph_events = False  # this torch/driver cannot record inside a capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    res = self._device_part(src, dev_u8, raw, outv)
            g = self._graphs[key] = (graph.replay, res, dev_u8, graph, self._graph_events)
        g[0]()
        if not g[4]:
            self._record(s)
        return g[1]

    def _event(self, s):
        e = self._events[s]
        if e is None:
            torch = self.torch
            if self._graph_events is not False:
                try:
                    e = torch.cuda.Event(external=True)  # recordable as a node of a captured graph
                    self._graph_events = True
                except TypeError:  # torch without external events
                    self._graph_events = False
            if e is None:
                e = torch.cuda.Event()
            self._events[s] = e
        return e

    def _record(self, s):
        if self.cuda:
            self._event(s).record()  # on the current stream, after the H2D that read slot s

    def _eager(self, s, n, k, dedup, raw):
        dev = self.device
        rows = self._rows[s][:k].to(dev, non_blocking=True, copy=True)
        # Deduplicated rows come in sorted-id order, so the inverse is needed even when every id
        # is distinct (k == n): skipping it there served a prefill's rows permuted (run38).
        inv_d = self._inv[s][:n].to(dev, non_blocking=True, copy=True) if dedup else None
        self._record(s)
        if inv_d is not None:
            rows = rows.index_select(0, inv_d)  # bytes expanded: NVFP4 rows decode once per token
        return self._values(rows, raw)

    def _lookup(self, flat, shape, wait_s, raw, out):
        t0 = time.perf_counter()
        n = flat.shape[0]
        if n > self.capacity:
            self._alloc(max(n, int(self.capacity * 1.5)))
        s = self._slot
        self._slot = (s + 1) % self.n_slots
        ev = self._events[s]
        if ev is not None:
            tw = time.perf_counter()
            ev.synchronize()  # the copy that last read this slot; not the whole device
            wait_s += time.perf_counter() - tw
        dedup = n >= self.dedup_min
        tg = time.perf_counter()
        if dedup:
            rows_np, inv = self.table.gather_unique(flat, out=self._rows_np[s])
            k = rows_np.shape[0]
            self._inv_np[s][:n] = inv
        else:
            self.table.gather(flat, out=self._rows_np[s][:n])
            k = n
        ts = time.perf_counter()
        if not dedup and 0 < n <= self.graph_max_rows:
            emb = self._replay(s, n, raw, out)
            if out is None:
                emb = emb.clone()  # the graph's output is static; the caller gets its own tensor
            emb = emb.view(*shape, self.table.head_dim) if out is None else out
        else:
            emb = self._eager(s, n, k, dedup, raw)
            emb = emb.view(*shape, self.table.head_dim)
            if out is not None:
                out.copy_(emb, non_blocking=True)
                emb = out
        if self.stats is not None:
            t1 = time.perf_counter()
            self.stats.record(ops=1, op_s=t1 - t0, gpu_wait_s=wait_s, stage_s=t1 - ts)
            self.stats.maybe_log()
        return emb
