"""Patch 2: FLA on GB10 (sm_121): the shared-memory gate and the `chunk_delta_h` warp pin.

- vLLM's vendored FLA enables its larger tiles when `check_shared_mem()` sees at least
  `Backend.DEFAULT` = 102,400 B; sm_121 has 101,376 B (99 KiB), so the GB10 runs the small-tile
  configs. The tiles fit in 99 KiB, so the default threshold becomes 101,376 (other arches keep
  theirs). Consumers evaluate the gate at import (`chunk_o.BKV_LIST`, `cumsum.BS_LIST`); vLLM
  loads general plugins before any model code, and `check()` refuses if a consumer was imported
  first with a different answer (its autotune configs would already be fixed).
- `chunk_gated_delta_rule_fwd_kernel_h_blockdim64` autotunes over num_warps 2 and 4; 4 races in
  a `tl.dot` on Blackwell (fla#953). The autotuner's configs are filtered to num_warps=2.
"""

from __future__ import annotations

import functools
import sys

from flash_common import releases

from ...registry import Context, Gate, Patch, TargetMissing, expect_installed, expect_source, install

NUMBER = 2
UTILS = "vllm.third_party.flash_linear_attention.ops.utils"
DELTA_H = "vllm.third_party.flash_linear_attention.ops.chunk_delta_h"
KERNEL = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
SM121_SHARED_MEM = 101_376
CONSUMERS = {  # module -> (constant, value when the gate is open, value when closed)
    "vllm.third_party.flash_linear_attention.ops.chunk_o": ("BKV_LIST", [64, 128], [32, 64]),
    "vllm.third_party.flash_linear_attention.ops.cumsum": ("BS_LIST", [32, 64], [16, 32]),
}


def _gate(orig):
    import vllm.third_party.flash_linear_attention.ops.utils as u

    @functools.cache
    def check_shared_mem(arch: str = "none", tensor_idx: int = 0) -> bool:
        try:
            have = u.get_all_max_shared_mem()[tensor_idx]
            need = u.Backend.get_shared_memory(arch)
            if need == u.Backend.DEFAULT.value:
                need = SM121_SHARED_MEM
            return have >= need
        except Exception:
            return False

    return check_shared_mem


def autotuner(kernel):
    """The triton Autotuner under the heuristics wrapper(s)."""
    obj = kernel
    for _ in range(4):
        if hasattr(obj, "configs") and hasattr(obj, "keys"):
            return obj
        obj = getattr(obj, "fn", None)
    raise TargetMissing(f"{DELTA_H}:{KERNEL} is not a triton autotuned kernel (is triton installed?)")


def check(ctx: Context) -> None:
    expect_source(UTILS, "check_shared_mem", "get_all_max_shared_mem()", "Backend.get_shared_memory(arch)")
    expect_source(UTILS, "Backend", "DEFAULT = 102400")
    import importlib

    mod = importlib.import_module(DELTA_H)
    tuner = autotuner(getattr(mod, KERNEL, None))
    if not {c.num_warps for c in tuner.configs} & {2}:
        raise TargetMissing(f"{KERNEL} has no num_warps=2 config to keep")


def apply(ctx: Context) -> None:
    new = install(NUMBER, UTILS, "check_shared_mem", _gate)
    for name, (const, open_, closed) in CONSUMERS.items():
        mod = sys.modules.get(name)  # only then ask the device (no CUDA init in the API server)
        if mod is not None and getattr(mod, const) != (open_ if new() else closed):
            raise TargetMissing(f"{name} was imported before flash_vllm registered; its {const} "
                                f"was fixed with the stock shared-memory gate")
    import importlib

    tuner = autotuner(getattr(importlib.import_module(DELTA_H), KERNEL))
    tuner.configs = [c for c in tuner.configs if c.num_warps == 2]
    getattr(tuner, "cache", {}).clear()  # forget any choice made with the old configs


def verify(ctx: Context) -> None:
    expect_installed(NUMBER, UTILS, "check_shared_mem")
    import importlib

    tuner = autotuner(getattr(importlib.import_module(DELTA_H), KERNEL))
    warps = {c.num_warps for c in tuner.configs}
    if warps != {2}:
        raise TargetMissing(f"{KERNEL} still autotunes over num_warps {sorted(warps)}")


PATCH = Patch(
    number=NUMBER,
    name="fla-sm121",
    title="FLA on GB10: 99 KiB shared-memory gate, chunk_delta_h num_warps=2",
    why=("The vendored FLA's 100 KiB gate keeps sm_121 (99 KiB) on small tiles, and "
         "chunk_delta_h's num_warps=4 configs race on Blackwell (fla#953)."),
    upstream="fla#953; no vLLM PR (unfixed through 0.33.0)",
    gate=Gate.always("always on (the gate only changes where shared memory is 99 KiB)"),
    targets=(f"{UTILS}:check_shared_mem", f"{DELTA_H}:{KERNEL}"),
    applies_to=releases.since("0.29.0"),
    check=check, apply=apply, verify=verify,
)
