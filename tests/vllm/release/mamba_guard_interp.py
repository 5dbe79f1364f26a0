"""Patch 3's kernels run for real on CPU under Triton's interpreter (`TRITON_INTERPRET=1`).

Run as a script inside a release venv (check_mamba_guard.py does it in a subprocess, so the
interpreter mode never leaks into the other checks); prints one JSON object of measured facts.
Also runs on a GPU with the compiled kernels: `--device cuda --stub-vllm <release's
mamba_utils.py>` on a machine with torch + triton and no vLLM (the module's imports are stubbed;
the kernels and `MambaSpecDecodeGPUContext` are the release's own code).

World: two Mamba groups (separate block tables and state pools of 12 and 9 blocks), each with one
layer holding an SD conv state (fp16 [blocks, 4, 24]) and a temporal state (fp32 [blocks, 3, 40]):
four state tensors, a real `MambaSpecDecodeGPUContext` (create + initialize_from_forward_context).

1. Stock kernels (before the patch) run the reference batch: the good requests, plus the partly
   bad ones with each bad block id replaced by a spare block of that pool.
2. Patch 3 is applied through the registry; a fresh context over an identical copy of the world
   runs the real batch (bad ids, bad columns).
3. Every (state tensor, block) is compared byte for byte: equal to the reference, except blocks
   whose copy had to be skipped (equal to the initial bytes) and the spare blocks (untouched).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

import torch

CONV_W, DIM, TH, TD = 4, 24, 3, 40
POOLS = (16, 12)         # num_blocks per group's state pool
COLS, MAX_REQS, BS = 5, 8, 4
SPARE = (15, 11)         # one unused block per pool: the reference's stand-in for a bad id


STUBS = {  # module -> source: just what mamba_utils.py and this harness import (GPU machine only)
    "vllm.config": "class CacheConfig: pass\n",
    "vllm.logger": "import logging\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm.model_executor.layers.mamba.mamba_utils": (
        "MambaStateCopyFuncsByType = dict\n"
        "def get_conv_copy_spec(*a): raise NotImplementedError\n"
        "def get_temporal_copy_spec(*a): raise NotImplementedError\n"
        "def is_conv_state_dim_first(): return False\n"),
    "vllm.triton_utils": "import triton\nimport triton.language as tl\n",
    "vllm.utils.gpu_sync_debug": "from contextlib import nullcontext as gpu_sync_allowed\n",
    "vllm.utils.math_utils": "def cdiv(a, b): return -(a // -b)\n",
    "vllm.v1.core.sched.output": "class SchedulerOutput: pass\n",
    "vllm.v1.kv_cache_interface": (
        "from dataclasses import dataclass\n"
        "@dataclass(frozen=True)\n"
        "class MambaSpec:\n"
        "    block_size: int\n    shapes: tuple\n    dtypes: tuple\n    mamba_type: str = 'mamba2'\n"
        "    mamba_cache_mode: str = 'none'\n    num_speculative_blocks: int = 0\n"
        "@dataclass\nclass KVCacheGroupSpec:\n    layer_names: list\n    kv_cache_spec: object\n"
        "@dataclass\nclass KVCacheConfig:\n    num_blocks: int\n    kv_cache_tensors: list\n"
        "    kv_cache_groups: list\n"
        "class UniformTypeKVCacheSpecs: pass\n"),
    "vllm.v1.utils": (
        "import torch\n"
        "class CpuGpuBuffer:\n"
        "    def __init__(self, *size, dtype, device, pin_memory=False):\n"
        "        self.cpu = torch.zeros(*size, dtype=dtype, pin_memory=pin_memory)\n"
        "        self.gpu = torch.zeros_like(self.cpu, device=device)\n"
        "        self.np = self.cpu.numpy()\n"
        "    def copy_to_gpu(self, n=None):\n"
        "        n = self.cpu.shape[0] if n is None else n\n"
        "        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)\n"),
    "vllm.v1.worker.gpu_input_batch": "class CachedRequestState: pass\nclass InputBatch: pass\n",
    "vllm.v1.worker.lora_model_runner_mixin": "class GPUInputBatch: pass\n",
}


def install_stubs(mamba_utils_py: str, version: str) -> None:
    """A machine without vLLM (the GPU one): the release's own mamba_utils.py over stub imports."""
    import importlib.util
    import types

    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers",
                 "vllm.model_executor.layers.mamba", "vllm.utils", "vllm.v1", "vllm.v1.core",
                 "vllm.v1.core.sched", "vllm.v1.worker"):
        mod = types.ModuleType(name)
        mod.__path__ = []
        sys.modules[name] = mod
    for name, src in STUBS.items():
        mod = types.ModuleType(name)
        sys.modules[name] = mod  # before exec: dataclasses look their module up
        exec(src, mod.__dict__)
    spec = importlib.util.spec_from_file_location("vllm.v1.worker.mamba_utils", mamba_utils_py)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    from flash_vllm import compat

    compat.installed_vllm_version = lambda: version


def world(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = []
    for n in POOLS:
        conv = torch.randn(n, CONV_W, DIM, generator=g).to(torch.float16)
        temp = torch.randn(n, TH, TD, generator=g)
        states.append([conv.to(device), temp.to(device)])
    return states


def make_ctx(mu, states, tables, device):
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.utils import CpuGpuBuffer

    spec = MambaSpec(block_size=BS, shapes=((CONV_W, DIM), (TH, TD)),
                     dtypes=(torch.float16, torch.float32), mamba_cache_mode="align",
                     num_speculative_blocks=1)
    groups = [KVCacheGroupSpec([f"layer{g}"], spec) for g in range(len(POOLS))]
    cfg = KVCacheConfig(num_blocks=max(POOLS), kv_cache_tensors=[], kv_cache_groups=groups)
    funcs = {spec.mamba_type: (get_conv_copy_spec, get_temporal_copy_spec)}

    def make_buffer(*size, dtype):
        return CpuGpuBuffer(*size, dtype=dtype, device=device, pin_memory=False)

    ctx = mu.MambaSpecDecodeGPUContext.create(max_num_reqs=MAX_REQS, kv_cache_config=cfg,
                                              copy_funcs=funcs, device=device,
                                              make_buffer=make_buffer)
    fwd = {f"layer{g}": type("Layer", (), {"kv_cache": states[g]})() for g in range(len(POOLS))}
    ctx.initialize_from_forward_context(cfg, fwd, funcs, tables)
    return ctx


def i32(xs, device):
    return torch.tensor(xs, dtype=torch.int32, device=device)


# Requests never share a block they touch, so the result does not depend on program order.
# --- precopy (run_fused_precopy): dst col = state_idx, src col = src_col, token_bias ----------
# r0, r1 good. r2: group 1's dst id 12 is past pool 1 (12 blocks) though inside pool 0.
# r3: group 0's src id is -3. r4: the temporal source column src_col + bias = 5 is past the row
# (the conv source column 3 is fine: conv copies happen). r5: dst column 5 is past the row.
PRE = [  # ((group 0 row, group 1 row), dst col, src col, bias)
    (([1, 2, 0, 0, 0], [1, 2, 0, 0, 0]), 1, 0, 1),
    (([3, 4, 5, 6, 0], [3, 4, 5, 6, 0]), 2, 1, 2),
    (([7, 8, 0, 0, 0], [7, 12, 0, 0, 0]), 1, 0, 0),
    (([-3, 9, 0, 0, 0], [9, 10, 0, 0, 0]), 1, 0, 0),
    (([0, 0, 0, 10, 12], [0, 0, 0, 3, 8]), 4, 3, 2),
    (([1, 1, 1, 1, 1], [1, 1, 1, 1, 1]), 5, 0, 0),
]
# the stock kernels' batch: bad ids -> the pool's spare block, bad columns -> src col -1 (no copy)
PRE_REF = [
    PRE[0], PRE[1],
    (([7, 8, 0, 0, 0], [7, SPARE[1], 0, 0, 0]), 1, 0, 0),
    (([SPARE[0], 9, 0, 0, 0], [9, 10, 0, 0, 0]), 1, 0, 0),
    (PRE[4][0], 4, -1, 2),
    (PRE[5][0], 5, -1, 0),
]
# (group, state 0 conv / 1 temporal, dst id) the guard skips (ids past the pool: nothing to see)
PRE_SKIPPED = {(1, 0, 12), (1, 1, 12), (0, 0, 9), (0, 1, 9), (0, 1, 12), (1, 1, 8)}
# copies the stock batch cannot express (the request also has a bad copy): (group, state, dst,
# src, bias); conv: dst[:W - bias] = src[bias:], temporal: dst = src
PRE_MODEL = [(0, 0, 12, 10, 2), (1, 0, 8, 3, 2)]
PRE_COUNT = 2 + 2 + 2 + 4

# --- postprocess (run_fused_postprocess): the decision is made in the kernel -------------------
# running = computed + scheduled - draft; new = running + accepted - 1; aligned = new // BS * BS;
# copy when aligned >= running: dst col = aligned // BS - 1, src col = mamba_state_idx,
# bias = aligned - running (conv reads src col, temporal src col + bias).
# r0: same-block shift (src == dst == col 1, bias 1). r1: col 1 -> 2, bias 2. r2: like r1, group
# 0's dst id 16 is past pool 0. r3: src col -1: conv copies skipped, temporal (col 1) copied.
POST = [  # (rows, state_idx, computed, scheduled, draft, accepted)
    (([1, 2, 3, 0, 0], [1, 2, 3, 0, 0]), 1, 6, 3, 2, 2),
    (([4, 5, 6, 7, 0], [4, 5, 6, 7, 0]), 1, 9, 3, 2, 3),
    (([8, 9, 16, 10, 0], [8, 9, 10, 4, 0]), 1, 9, 3, 2, 3),
    (([0, 13, 14, 0, 0], [0, 8, 1, 0, 0]), -1, 9, 3, 2, 3),
]
POST_REF = [POST[0], POST[1], (([8, 9, SPARE[0], 10, 0], [8, 9, 10, 4, 0]), 1, 9, 3, 2, 3)]
POST_SKIPPED = {(0, 0, 16), (0, 1, 16), (0, 0, 14), (1, 0, 1)}
POST_MODEL = [(0, 1, 14, 13, 0), (1, 1, 1, 8, 0)]
POST_COUNT = 2 + 2


def tables_for(rows, device):
    out = []
    for g in range(len(POOLS)):
        t = torch.zeros(MAX_REQS, COLS, dtype=torch.int32)
        for r, row in enumerate(rows):
            t[r] = torch.tensor(row[g], dtype=torch.int32)
        out.append(t.to(device))
    return out


def run_pre(mu, states, spec, device):
    tables = tables_for([s[0] for s in spec], device)
    ctx = make_ctx(mu, states, tables, device)
    n = len(spec)
    ctx.run_fused_precopy(num_reqs=n, state_idx_gpu=i32([s[1] for s in spec], device),
                          src_col_gpu=i32([s[2] for s in spec], device),
                          token_bias_gpu=i32([s[3] for s in spec], device), idx_mapping=None)
    return ctx


def run_post(mu, states, spec, device):
    tables = tables_for([s[0] for s in spec], device)
    ctx = make_ctx(mu, states, tables, device)
    n = len(spec)
    col = lambda k: i32([s[k] for s in spec], device)  # noqa: E731
    accepted = col(5)
    ctx.run_fused_postprocess(num_reqs=n, num_accepted_tokens_gpu=accepted, mamba_state_idx_gpu=col(1),
                              num_scheduled_tokens_gpu=col(3), num_computed_tokens_gpu=col(2),
                              num_draft_tokens_gpu=col(4))
    return ctx, ctx.num_accepted_tokens_out[:n].cpu().tolist()


def compare(initial, ref, got, skipped, model):
    """(group, state, block) units whose bytes differ from the expectation, and how many checked."""
    bad, checked = [], 0
    for g, n in enumerate(POOLS):
        for s in (0, 1):
            want = ref[g][s].clone()
            for (gg, ss, blk) in skipped:
                if (gg, ss) == (g, s) and 0 <= blk < n:
                    want[blk] = initial[g][s][blk]
            want[SPARE[g]] = initial[g][s][SPARE[g]]
            for (gg, ss, dst, src, bias) in model:
                if (gg, ss) == (g, s):
                    if s == 0:
                        want[dst, :CONV_W - bias] = initial[g][s][src, bias:]
                    else:
                        want[dst] = initial[g][s][src]
            for blk in range(n):
                checked += 1
                if not torch.equal(got[g][s][blk].contiguous().view(torch.uint8),
                                   want[blk].contiguous().view(torch.uint8)):
                    bad.append([g, s, blk])
    return bad, checked


def changed(initial, after):
    return sorted([g, s, b] for g in range(len(POOLS)) for s in (0, 1) for b in range(POOLS[g])
                  if not torch.equal(initial[g][s][b], after[g][s][b]))


def cpu(states):
    return [[t.cpu() for t in g] for g in states]


def bench(mu, device, layers, conv_shape, temp_shape, dtype, reqs, rounds=7, iters=20):
    """Per-launch time of the stock vs the guarded precopy kernel, same context and batch, in
    alternating rounds (GPU only). Every request copies one block per state tensor."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.utils import CpuGpuBuffer

    nb = 2 * reqs + 2
    spec = MambaSpec(block_size=BS, shapes=(conv_shape, temp_shape), dtypes=(dtype, dtype),
                     mamba_cache_mode="align", num_speculative_blocks=1)
    names = [f"l{i}" for i in range(layers)]
    cfg = KVCacheConfig(num_blocks=nb, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    funcs = {spec.mamba_type: (get_conv_copy_spec, get_temporal_copy_spec)}
    fwd = {n: type("Layer", (), {"kv_cache": [torch.randn(nb, *conv_shape, device=device).to(dtype),
                                              torch.randn(nb, *temp_shape, device=device).to(dtype)]})()
           for n in names}
    table = torch.zeros(MAX_REQS if reqs <= MAX_REQS else reqs, COLS, dtype=torch.int32)
    for r in range(reqs):
        table[r, 0], table[r, 1] = 2 + 2 * r, 3 + 2 * r
    table = table.to(device)
    ctx = mu.MambaSpecDecodeGPUContext.create(
        max_num_reqs=table.shape[0], kv_cache_config=cfg, copy_funcs=funcs, device=device,
        make_buffer=lambda *size, dtype: CpuGpuBuffer(*size, dtype=dtype, device=device, pin_memory=False))
    ctx.initialize_from_forward_context(cfg, fwd, funcs, [table])
    dst = i32([1] * reqs, device)
    src = i32([0] * reqs, device)
    bias = i32([0] * reqs, device)
    guarded_kernel = mu.precopy_mamba_align_fused_kernel
    guarded_launch = mu.MambaSpecDecodeGPUContext.run_fused_precopy
    stock_kernel, stock_launch = guarded_kernel.__flash_original__, guarded_launch.__flash_original__

    guarded_copy = mu._copy_mamba_state_block

    def timed(kernel, launch):
        # the stock launcher and kernel resolve their callees by name in the module
        mu.precopy_mamba_align_fused_kernel = kernel
        mu._copy_mamba_state_block = guarded_copy if kernel is guarded_kernel else guarded_copy.__flash_original__
        try:
            for _ in range(3):
                launch(ctx, reqs, dst, src, bias, None)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                launch(ctx, reqs, dst, src, bias, None)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1000 / iters
        finally:
            mu.precopy_mamba_align_fused_kernel = guarded_kernel
            mu._copy_mamba_state_block = guarded_copy

    stock, guarded = [], []
    for _ in range(rounds):
        stock.append(timed(stock_kernel, stock_launch))
        guarded.append(timed(guarded_kernel, guarded_launch))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    per_launch = layers * 2 * reqs
    bytes_ = reqs * layers * (torch.Size(conv_shape).numel() + torch.Size(temp_shape).numel()) * dtype.itemsize
    return {"layers": layers, "conv": list(conv_shape), "temporal": list(temp_shape), "dtype": str(dtype),
            "reqs": reqs, "state_copies_per_launch": per_launch, "bytes_per_launch": bytes_,
            "stock_us": [round(x, 2) for x in stock], "guarded_us": [round(x, 2) for x in guarded],
            "median_stock_us": round(med(stock), 2), "median_guarded_us": round(med(guarded), 2),
            "ratio": round(med(guarded) / med(stock), 4),
            "counter": int(mamba_guard_counter(ctx))}


def mamba_guard_counter(ctx):
    from flash_vllm.patches import p03_mamba_copy_guard as mamba_guard

    return mamba_guard.guard_of(ctx).counter.item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--stub-vllm", metavar="MAMBA_UTILS_PY",
                    help="no vLLM here: load this release's mamba_utils.py over stub imports")
    ap.add_argument("--release", default="0.33.0", help="with --stub-vllm: its version")
    ap.add_argument("--bench", action="store_true", help="GPU: also time stock vs guarded precopy")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.stub_vllm:
        install_stubs(args.stub_vllm, args.release)
    from vllm.v1.worker import mamba_utils as mu

    facts = {"device": str(device), "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
             "stock_kernel": type(mu.precopy_mamba_align_fused_kernel).__name__}
    initial = cpu(world(device))

    # 1. the stock kernels: the good requests alone, and the reference batches
    stock = {}
    for name, runner, spec in (("good_pre", run_pre, PRE[:2]), ("pre", run_pre, PRE_REF),
                               ("good_post", run_post, POST[:2]), ("post", run_post, POST_REF)):
        states = world(device)
        out = runner(mu, states, spec, device)
        stock[name] = (cpu(states), out[1] if isinstance(out, tuple) else None)
    facts["stock_changed"] = {k: changed(initial, v[0]) for k, v in stock.items()}

    # 2. the patch, through the registry
    from flash_vllm import compat
    from flash_vllm.patches import p03_mamba_copy_guard as mamba_guard
    from flash_vllm.registry import Context, by_number

    patch = by_number(3)
    c = Context(compat.resolve(compat.installed_vllm_version(), {}), {})
    patch.check(c)
    patch.apply(c)
    patch.verify(c)
    patch.apply(c)
    facts["patched_kernel"] = type(mu.precopy_mamba_align_fused_kernel).__name__
    facts["patched_src_has_guard"] = "flash patch 3 begin" in inspect.getsource(mu._copy_mamba_state_block.fn)

    # 3. the patched kernels on the same batches with the bad ids and columns
    runs = (("good_pre", run_pre, PRE[:2], set(), []), ("pre", run_pre, PRE, PRE_SKIPPED, PRE_MODEL),
            ("good_post", run_post, POST[:2], set(), []),
            ("post", run_post, POST, POST_SKIPPED, POST_MODEL))
    for name, runner, spec, skipped, model in runs:
        states = world(device)
        out = runner(mu, states, spec, device)
        ctx = out[0] if isinstance(out, tuple) else out
        guard = mamba_guard.guard_of(ctx)
        got = cpu(states)
        bad, checked = compare(initial, stock[name][0], got, skipped, model)
        facts[name] = {"counter": int(guard.counter.item()), "mismatch": bad, "checked": checked,
                       "changed": changed(initial, got),
                       "identical_to_stock": all(torch.equal(a.view(torch.uint8).flatten(),
                                                             b.view(torch.uint8).flatten())
                                                 for ga, gb in zip(got, stock[name][0])
                                                 for a, b in zip(ga, gb)),
                       "num_blocks": guard.num_blocks.cpu().tolist()}
        if isinstance(out, tuple):
            facts[name]["accepted_out"] = out[1]
            facts[name]["stock_accepted_out"] = stock[name][1]
    facts["want_counter"] = {"pre": PRE_COUNT, "post": POST_COUNT}

    # 4. the asynchronous report of the last context: one log line per increase
    import logging

    lines = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logging.getLogger("vllm.flash").addHandler(handler)
    later = guard._next  # the launch's own poll (counter 0 then) scheduled the next one here
    guard.poll(now=later - 1e-3)  # too early: nothing read
    early = list(lines)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()  # test only: let the enqueued counter copies land before reading them
    guard.poll(now=later)
    sync()
    guard.poll(now=later + guard.interval)
    sync()
    guard.poll(now=later + 2 * guard.interval)  # no increase since: no second line
    facts["report_early"] = early
    facts["report_lines"] = lines
    if args.bench and device.type == "cuda":
        facts["bench"] = [
            # 48 GDN-like layers: conv [4, 8192] + temporal [16, 128, 128] bf16 (~0.5 MiB a block)
            bench(mu, device, 48, (CONV_W, 8192), (16, 128, 128), torch.bfloat16, 32),
            # tiny states: the guard's extra loads weigh the most
            bench(mu, device, 48, (CONV_W, 64), (2, 64), torch.bfloat16, 32),
        ]
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
