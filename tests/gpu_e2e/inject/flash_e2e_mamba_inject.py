"""gpu-e2e fault injection for patch 3: one fused Mamba state copy reads an out-of-range block id.

Test-only; loaded into a server only through tests/gpu_e2e/inject/sitecustomize.py (the fleet puts
that directory on the PYTHONPATH of its `guard-p3*` servers, with FLASH_E2E_INJECT=mamba-copy). The
shipped plugin never imports it.

What it does. `MambaSpecDecodeGPUContext.initialize_from_forward_context` is wrapped (a method patch 3
leaves alone) to keep the per-group block-table tensors it is handed: `_populate_metadata` stores
their `data_ptr()` in `block_table_ptrs`, which is exactly what the fused kernels read block ids
from. On that context instance (not the class: patch 3 rewrites the class's launchers and checks
their source at registration, before any context exists) `run_fused_precopy` is wrapped: at the
first launch in which some request crosses a Mamba block boundary (its source column >= 0 and not its
destination column: the kernel will copy), the destination entry of the row the kernel reads for it
(its request slot on 0.33, its batch position on 0.29: ROW_ARG) in the first group's table is set to FLASH_E2E_INJECT_BLOCK_ID (default 2^30, far past any pool) for that one
launch and restored right after, in stream order. The forward kernels never see the bad id; only
that copy does. Patch 3 skips it and counts one per state tensor of the group; stock vLLM computes
an address ~2^30 blocks past the pool (an illegal access).

Reading the columns needs a device sync; it happens only until the injection fires (test-only), and
never while a CUDA graph is captured (vLLM launches the precopy on real batches only anyway).
Each step prints one machine-readable line to stderr (the server log), `FLASH_E2E_MAMBA_INJECT
ready|fired|refused: ...`; fleet.check_guard_p3 reads them.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import threading

TARGET_MODULE = "vllm.v1.worker.mamba_utils"
CTX = "MambaSpecDecodeGPUContext"
INIT = "initialize_from_forward_context"
LAUNCHER = "run_fused_precopy"
# The source facts the injection relies on, per release (checked at install; a move refuses loudly):
# the tables handed to INIT are the ones whose data_ptr the kernels read, and the precopy launch
# reads them through block_table_ptrs with the columns it is given.
ANCHORS = {
    "_populate_metadata": ("self.block_table_ptrs[i] = _reinterpret_u64_as_i64(", "bt.data_ptr()"),
    LAUNCHER: ("precopy_mamba_align_fused_kernel[grid](", "self.block_table_ptrs,"),
    "precopy_mamba_align_fused_kernel": ("src_col = tl.load(src_col_ptr + req_idx)",
                                         "dst_col = tl.load(mamba_state_idx_ptr + req_idx)",
                                         "if src_col < 0 or src_col == dst_col:"),
}
# Which block-table row the precopy kernel reads for a batch entry: its second argument to the copy
# body. 0.33 passes req_idx (per-request-slot tables); 0.29 passes batch_idx (batch-ordered tables).
ROW_ARG = re.compile(r"_copy_mamba_state_block\(\s*state_idx,\s*(\w+),")
ROWS = ("req_idx", "batch_idx")
INIT_PARAMS = ("kv_cache_config", "forward_context", "mamba_state_copy_funcs", "block_tables")
LAUNCH_PARAMS = ("num_reqs", "state_idx_gpu", "src_col_gpu", "token_bias_gpu", "idx_mapping")
BAD_DEFAULT = 1 << 30


def say(kind: str, what) -> None:
    text = what if isinstance(what, str) else json.dumps(what, sort_keys=True)
    print(f"FLASH_E2E_MAMBA_INJECT {kind}: {text}", file=sys.stderr, flush=True)


class Refused(RuntimeError):
    pass


def _source(obj) -> str:
    obj = getattr(obj, "__flash_original__", obj)  # patch 3 installed: read the release's own
    obj = getattr(obj, "fn", obj)                   # a Triton JITFunction: its Python function
    return inspect.getsource(obj)


def check(mu) -> str:
    """The release still looks as the injection assumes (Refused, naming what moved, otherwise); returns
    how the precopy kernel picks its block-table row (ROWS)."""
    ctx = getattr(mu, CTX, None)
    if ctx is None:
        raise Refused(f"{TARGET_MODULE}.{CTX} is gone")
    for name, needles in ANCHORS.items():
        owner = mu if hasattr(mu, name) else ctx
        obj = getattr(owner, name, None)
        if obj is None:
            raise Refused(f"{TARGET_MODULE}: no {name}")
        src = _source(obj)
        missing = [n for n in needles if n not in src]
        if missing:
            raise Refused(f"{TARGET_MODULE}:{name} no longer contains {missing}")
    for name, want in ((INIT, INIT_PARAMS), (LAUNCHER, LAUNCH_PARAMS)):
        params = list(inspect.signature(getattr(ctx, name)).parameters)[1:]
        if params[:len(want)] != list(want):
            raise Refused(f"{CTX}.{name}{tuple(params)}: expected the parameters {want} first")
    rows = ROW_ARG.findall(_source(mu.precopy_mamba_align_fused_kernel))
    if len(rows) != 1 or rows[0] not in ROWS:
        raise Refused(f"precopy_mamba_align_fused_kernel passes the copy body the row {rows}, not one of {ROWS}")
    return rows[0]


def install(mu, bad: int | None = None) -> None:
    """Wrap `mu.MambaSpecDecodeGPUContext.initialize_from_forward_context` (idempotent)."""
    row_by = check(mu)
    ctx_cls = getattr(mu, CTX)
    orig = ctx_cls.__dict__[INIT]
    if getattr(orig, "__flash_e2e_inject__", False):
        return
    bad = int(os.environ.get("FLASH_E2E_INJECT_BLOCK_ID", BAD_DEFAULT)) if bad is None else bad
    state = {"fired": False, "lock": threading.Lock()}
    sig = inspect.signature(orig)

    def initialize_from_forward_context(self, *args, **kwargs):
        tables = list(sig.bind(self, *args, **kwargs).arguments["block_tables"])
        out = orig(self, *args, **kwargs)
        if LAUNCHER not in self.__dict__:
            self.__dict__[LAUNCHER] = _precopy(self, getattr(self, LAUNCHER), tables, bad, state, row_by)
            say("ready", {"groups": len(tables), "states": int(self.num_states), "bad_block_id": bad, "row_by": row_by,
                          "launcher_patched_by": getattr(getattr(type(self), LAUNCHER), "__flash_patch__", None)})
        return out

    initialize_from_forward_context.__flash_e2e_inject__ = True
    initialize_from_forward_context.__wrapped__ = orig
    setattr(ctx_cls, INIT, initialize_from_forward_context)


def _precopy(ctx, launch, tables, bad: int, state: dict, row_by: str):
    import torch

    sig = inspect.signature(launch)

    def run_fused_precopy(*args, **kwargs):
        if state["fired"] or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return launch(*args, **kwargs)
        a = sig.bind(*args, **kwargs).arguments
        n = int(a["num_reqs"])
        if n == 0 or not ctx.is_initialized:
            return launch(*args, **kwargs)
        idx = a["idx_mapping"]
        reqs = idx[:n].tolist() if idx is not None else list(range(n))
        src, dst = a["src_col_gpu"].tolist(), a["state_idx_gpu"].tolist()  # sync: test only, until fired
        # columns are per request (req_idx); the table row is req_idx or batch_idx by release (ROW_ARG)
        hit = next(((r if row_by == "req_idx" else b, src[r], dst[r]) for b, r in enumerate(reqs)
                    if r >= 0 and src[r] >= 0 and src[r] != dst[r]), None)
        with state["lock"]:
            if hit is None or state["fired"]:
                return launch(*args, **kwargs)
            state["fired"] = True
        row, src_col, dst_col = hit
        table = tables[0]
        # the kernel reads group 0's ids from this address: the table we corrupt must be that one
        want = int(ctx.block_table_ptrs[0].item()) % (1 << 64)
        if table.data_ptr() != want:
            say("refused", f"group 0's table at {table.data_ptr():#x}, the kernel reads {want:#x}")
            return launch(*args, **kwargs)
        flat = torch.empty(0, dtype=table.dtype, device=table.device).set_(table.untyped_storage())
        at = table.storage_offset() + row * table.stride(0) + dst_col * table.stride(1)
        saved = flat[at].clone()
        was = int(saved.item())
        flat[at] = bad
        try:
            return launch(*args, **kwargs)
        finally:
            flat[at].copy_(saved)  # same stream, after the launch: later steps see the real id
            say("fired", {"group": 0, "row": row, "src_col": src_col, "dst_col": dst_col, "block_id": was,
                          "bad_block_id": bad, "num_reqs": n, "states": int(ctx.num_states),
                          "v2_idx_mapping": idx is not None})

    run_fused_precopy.__flash_e2e_inject__ = True
    return run_fused_precopy
