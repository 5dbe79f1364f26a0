"""Patch 3: bounds guard on the block ids of the fused Mamba state-copy kernels.

vLLM's GPU-side Mamba state copies (`vllm/v1/worker/mamba_utils.py`, spec decode + hybrid +
`mamba_cache_mode=align`) load block ids from the persistent block tables inside Triton kernels
and turn them into addresses (`state_base + block_id * block_stride`) with no `< num_blocks` or
`>= 0` check; `num_blocks` never reaches the kernel. One bad id (a stale state index, a column
past the request's row) is an illegal access (Xid 31) that takes the engine down. The upstream
recipe replaced the whole 68 KB file; here only the kernels are rewritten, in memory:

- `_copy_mamba_state_block` (the shared copy body) gets two more arguments: the block count of
  every state pool (`state_num_blocks`, int64[num_states]) and a device counter (int32[1]).
  Before its first block-id load it checks that both block-table columns it will read lie in
  the row (`0 <= col < block_table_stride_req`) and that both block ids lie in the pool
  (`0 <= id < num_blocks`); otherwise it skips the copy and `tl.atomic_add`s the counter (tile 0
  only, so one skipped (request, state tensor) copy counts once). In-range copies run the
  release's own code, unchanged.
- `postprocess_mamba_fused_kernel` and `precopy_mamba_align_fused_kernel` pass the two through;
  the three launchers of `MambaSpecDecodeGPUContext` pass the context's tensors;
  `_populate_metadata` records `state.shape[0]` of each state tensor in the same loop that
  records its base address (so the order cannot drift) and uploads them once at init.

Every rewrite is an anchor that must occur exactly once in the release's source; `check()` runs
the same rewrite without installing it, so a release that moves a target fails loudly. The
count is read without a device sync: every few seconds a launcher enqueues a non-blocking copy
of the counter into pinned memory behind an event, and a later launch reads it once the event
has completed, logging "mamba state-copy guard: N out-of-range" when it grew. Nothing is
enqueued while a CUDA graph is being captured.

The scalar (non-fused) copy path takes its addresses from `state[block_id]` on the host, which is
memory-safe (torch raises on an id past the pool; a negative id wraps to a real block), so it is
left alone. vllm#50729 (the overlapping-copy race the
upstream file also fixed) is in every release from 0.29.0; `check()` asserts it is still there.
"""

from __future__ import annotations

import inspect
import linecache
import logging
import re
import textwrap
import threading
import time
from typing import Any

from flash_common import releases

from ...registry import (Context, Gate, Patch, TargetMissing, expect_installed, import_target,
                        install, is_ours, original, resolve)

NUMBER = 3
MOD = "vllm.v1.worker.mamba_utils"
CTX = "MambaSpecDecodeGPUContext"
COPY = "_copy_mamba_state_block"
CALLERS = ("postprocess_mamba_fused_kernel", "precopy_mamba_align_fused_kernel")
LAUNCHERS = ("run_fused_postprocess", "run_fused_precopy", "run_fused_postprocess_align")
POPULATE = "_populate_metadata"
GUARD_ARGS = ("state_num_blocks_ptr", "guard_counter_ptr")
REPORT_EVERY_S = 5.0
MESSAGE = "mamba state-copy guard: %d out-of-range (state copies skipped; +%d since the last report)"
log = logging.getLogger("vllm.flash")

# vllm#50729's design as it reads in 0.29.0+ (the race fix the upstream drop-in also carried).
RACE_FIX = ("Stable row-to-lane ownership makes left shifts memmove-safe",
            "if src_block_id != dest_block_id or token_bias == 0:")
# The block-id loads of the copy body: the guard covers exactly these columns (dst_col for every
# state; src_col for conv states, src_col + token_bias for temporal ones). A new load = new review.
LOADS = {
    "dest_block_id = tl.load(block_table_base + dst_col).to(tl.int64)": 1,
    "src_block_id = tl.load(block_table_base + src_col).to(tl.int64)": 2,
    "actual_src_block_id = tl.load(block_table_base + src_col + token_bias).to(tl.int64)": 1,
    "tl.load(block_table_base": 4,
    "is_conv_state = conv_width > 0": 1,
}

GUARD_BLOCK = """\
{i}# --- flash patch 3 begin: bounds guard on block-table columns and state block ids
{i}guard_src_col = src_col + tl.where(conv_width > 0, 0, token_bias)
{i}guard_cols_ok = (
{i}    (dst_col >= 0)
{i}    & (dst_col < block_table_stride_req)
{i}    & (guard_src_col >= 0)
{i}    & (guard_src_col < block_table_stride_req)
{i})
{i}guard_num_blocks = tl.load(state_num_blocks_ptr + state_idx)
{i}guard_dst_id = tl.load(
{i}    block_table_base + dst_col, mask=guard_cols_ok, other=-1
{i}).to(tl.int64)
{i}guard_src_id = tl.load(
{i}    block_table_base + guard_src_col, mask=guard_cols_ok, other=-1
{i}).to(tl.int64)
{i}guard_bad = (
{i}    (guard_dst_id < 0)
{i}    | (guard_dst_id >= guard_num_blocks)
{i}    | (guard_src_id < 0)
{i}    | (guard_src_id >= guard_num_blocks)
{i})
{i}if guard_bad:
{i}    if tile_idx == 0:
{i}        tl.atomic_add(guard_counter_ptr, 1)
{i}    return
{i}# --- flash patch 3 end
"""


# --- the source rewrite ------------------------------------------------------------------

def _sub_once(src: str, where: str, pattern: str, repl) -> str:
    """Replace the single match of `pattern` (re.M); anything but exactly one match is fatal."""
    hits = list(re.finditer(pattern, src, re.M))
    if len(hits) != 1:
        raise TargetMissing(f"{MOD}:{where}: expected exactly one match of {pattern!r}, "
                            f"found {len(hits)}")
    m = hits[0]
    return src[:m.start()] + (repl(m) if callable(repl) else repl) + src[m.end():]


def _count(src: str, where: str, needle: str, want: int) -> None:
    got = src.count(needle)
    if got != want:
        raise TargetMissing(f"{MOD}:{where}: expected {want} x {needle!r}, found {got}")


def _pass_through(src: str, where: str) -> str:
    """Thread the guard arguments after `state_dim_row_stride_ptr` in a signature and a call."""
    src = _sub_once(src, f"{where} (signature)", r"^(    )state_dim_row_stride_ptr,[^\n]*\n",
                    lambda m: m.group(0) + "".join(f"{m.group(1)}{a},\n" for a in GUARD_ARGS))
    return _sub_once(src, f"{where} (call to {COPY})", r"^(        )state_dim_row_stride_ptr,\n",
                     lambda m: m.group(0) + "".join(f"{m.group(1)}{a},\n" for a in GUARD_ARGS))


def _raw(obj: Any) -> Any:
    """The Python function under a Triton JIT wrapper (or vLLM's placeholder: the function)."""
    obj = original(obj)
    return getattr(obj, "fn", obj)


def _source(qualname: str) -> str:
    _, _, value = resolve(MOD, qualname)
    try:
        return textwrap.dedent(inspect.getsource(_raw(value)))
    except (OSError, TypeError) as e:
        raise TargetMissing(f"{MOD}:{qualname}: source unavailable ({e})") from e


def rewritten_sources() -> dict[str, str]:
    """qualname -> patched source, from the release's (unpatched) source. Raises TargetMissing."""
    out = {}
    src = _source(COPY)
    for needle in RACE_FIX:
        _count(src, COPY, needle, 1)
    for needle, want in LOADS.items():
        _count(src, COPY, needle, want)
    if "atomic_add" in src or "num_blocks" in src:
        raise TargetMissing(f"{MOD}:{COPY} already bounds-checks block ids (fixed upstream?)")
    src = _sub_once(src, f"{COPY} (signature)", r"^(    )state_dim_row_stride_ptr,\n(    tile_idx,\n)",
                    lambda m: m.group(0)[:-len(m.group(2))]
                    + "".join(f"{m.group(1)}{a},\n" for a in GUARD_ARGS) + m.group(2))
    out[COPY] = _sub_once(
        src, f"{COPY} (first block-id load)",
        r"^( +)dest_block_id = tl\.load\(block_table_base \+ dst_col\)\.to\(tl\.int64\)\n",
        lambda m: GUARD_BLOCK.format(i=m.group(1)) + m.group(0))
    for name in CALLERS:
        src = _source(name)
        _count(src, name, f"{COPY}(", 1)
        out[name] = _pass_through(src, name)
    for name in LAUNCHERS:
        q = f"{CTX}.{name}"
        src = _source(q)
        _count(src, q, "_fused_kernel[grid](", 1)
        out[q] = _sub_once(src, q, r"^( +)self\.state_dim_row_stride,\n",
                           lambda m: m.group(0) + f"{m.group(1)}*_flash_mamba_guard_args(self),\n")
    q = f"{CTX}.{POPULATE}"
    src = _source(q)
    src = _sub_once(src, f"{q} (per-state metadata)",
                    r"^( +)self\.state_elem_sizes\[idx\] = state\.element_size\(\)\n",
                    lambda m: m.group(0) + f"{m.group(1)}_flash_mamba_guard_of(self).record(idx, state)\n")
    out[q] = _sub_once(src, f"{q} (end)", r"^( +)self\.is_initialized = True\n",
                       lambda m: f"{m.group(1)}_flash_mamba_guard_of(self).publish()\n" + m.group(0))
    return out


def _compile(qualname: str, src: str, namespace: dict) -> Any:
    """Define `src` in `namespace` under a file name linecache serves (Triton reads the source)."""
    filename = f"<flash_vllm patch 3: {MOD}:{qualname}>"
    lines = src.splitlines(keepends=True)
    linecache.cache[filename] = (len(src), None, lines, filename)  # mtime None: never evicted
    # dont_inherit: this module's `from __future__ import annotations` must not turn the
    # kernels' `tl.constexpr` annotations into strings.
    exec(compile(src, filename, "exec", dont_inherit=True), namespace)
    return namespace[qualname.rsplit(".", 1)[-1]]


def build() -> dict[str, Any]:
    """qualname -> new object. Kernels are redefined with the module's own `triton` (JIT or the
    placeholder), in a copy of its namespace whose `_copy_mamba_state_block` is the guarded one."""
    sources = rewritten_sources()
    ns = dict(vars(import_target(MOD)))
    ns["_flash_mamba_guard_args"] = guard_args
    ns["_flash_mamba_guard_of"] = guard_of
    return {q: _compile(q, s, ns) for q, s in sources.items()}


# --- the runtime side: block counts, the counter, asynchronous reporting -----------------

class StateCopyGuard:
    """Per-context guard state: block count per state tensor, the device counter, the reporter."""

    def __init__(self, ctx: Any):
        import torch

        self.device = ctx.state_base_addrs.device
        self.host_num_blocks = [-1] * int(ctx.num_states)
        self.num_blocks = None  # int64[num_states] on the device, set by publish()
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.interval = REPORT_EVERY_S
        self.reported = 0
        self._next = 0.0
        self._host = None
        self._pending = None
        self._lock = threading.Lock()

    def record(self, idx: int, state: Any) -> None:
        self.host_num_blocks[idx] = int(state.shape[0])  # state shape: [num_blocks, ...]

    def publish(self) -> None:
        import torch

        missing = [i for i, n in enumerate(self.host_num_blocks) if n < 0]
        if missing:
            raise RuntimeError(f"flash_vllm patch 3: no block count for Mamba state(s) {missing}")
        self.num_blocks = torch.tensor(self.host_num_blocks, dtype=torch.int64).to(self.device)
        if self.device.type == "cuda":
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        log.info("flash_vllm: mamba state-copy guard on %d state tensors (block counts %s)",
                 len(self.host_num_blocks), sorted(set(self.host_num_blocks)))

    def poll(self, now: float | None = None) -> None:
        """Called by every launch; host-only work except a non-blocking D2H copy every interval."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        with self._lock:
            self._next = now + self.interval
            self._collect()

    def _collect(self) -> None:
        if self.device.type != "cuda":  # CPU tensors (the interpreter tier): no device to wait for
            self._seen(int(self.counter[0]))
            return
        import torch

        if torch.cuda.is_current_stream_capturing():
            return
        if self._pending is not None:
            if not self._pending.query():  # still in flight: look again next interval
                return
            self._seen(int(self._host[0]))
        self._host.copy_(self.counter, non_blocking=True)
        self._pending = torch.cuda.Event()
        self._pending.record()

    def _seen(self, value: int) -> None:
        if value > self.reported:
            log.warning(MESSAGE, value, value - self.reported)
            self.reported = value


def guard_of(ctx: Any) -> StateCopyGuard:
    guard = ctx.__dict__.get("_flash_mamba_guard")
    if guard is None:
        guard = StateCopyGuard(ctx)
        ctx._flash_mamba_guard = guard
    return guard


def guard_args(ctx: Any) -> tuple[Any, Any]:
    """(state_num_blocks, counter) for a launch; the launchers only run once initialized."""
    guard = ctx.__dict__.get("_flash_mamba_guard")
    if guard is None or guard.num_blocks is None:
        raise RuntimeError("flash_vllm patch 3: Mamba state-copy launch before the guard's block "
                           "counts were recorded (_populate_metadata did not run patched)")
    guard.poll()
    return guard.num_blocks, guard.counter


# --- the registry unit -------------------------------------------------------------------

def targets() -> tuple[tuple[str, str], ...]:
    return ((MOD, COPY), *((MOD, n) for n in CALLERS),
            *((MOD, f"{CTX}.{n}") for n in (*LAUNCHERS, POPULATE)))


def check(ctx: Context) -> None:
    import_target(MOD)
    done = [is_ours(resolve(m, q)[2], NUMBER) for m, q in targets()]
    rewritten_sources()  # reads the originals under our replacements when already applied
    if any(done) and not all(done):
        raise TargetMissing(f"{MOD}: patch 3 is only partly installed")


def apply(ctx: Context) -> None:
    if all(is_ours(resolve(m, q)[2], NUMBER) for m, q in targets()):
        return
    new = build()
    # the copy body first: the callers' namespace already holds the guarded one
    for module, qualname in targets():
        install(NUMBER, module, qualname, lambda orig, q=qualname: new[q])


def verify(ctx: Context) -> None:
    for module, qualname in targets():
        expect_installed(NUMBER, module, qualname)
    for name in (COPY, *CALLERS):
        params = inspect.signature(_raw_installed(name)).parameters
        if not all(a in params for a in GUARD_ARGS):
            raise TargetMissing(f"{MOD}:{name} lacks the guard arguments after apply")


def _raw_installed(name: str) -> Any:
    _, _, value = resolve(MOD, name)
    return getattr(value, "fn", value)


PATCH = Patch(
    number=NUMBER,
    name="mamba-copy-guard",
    title="Bounds guard on Mamba state-copy block ids",
    why=("The fused Mamba state-copy kernels (spec decode + hybrid + align mode) turn block-table "
         "entries into addresses with no bounds check, so one bad id is an illegal access (Xid 31) "
         "that kills the engine. The kernels are rewritten in memory: a column outside the row or "
         "a block id outside [0, num_blocks) of its state pool skips that copy and bumps a device "
         "counter, reported asynchronously as 'mamba state-copy guard: N out-of-range'. In-range "
         "copies run the release's code unchanged. A safety net: with patch 4 the counter stays 0."),
    upstream=("none through 0.33.0 (the overlapping-copy race fix vllm#50729, which the upstream "
              "drop-in also carried, is in 0.29.0+ and asserted by check())"),
    gate=Gate.always("always on, like upstream (only an out-of-bounds copy is ever skipped)"),
    targets=tuple(f"{m}:{q}" for m, q in targets()),
    applies_to=releases.since("0.29.0"),
    check=check, apply=apply, verify=verify,
    notes=("No Prometheus family yet: the counter lives in the GPU worker and the metrics bridge "
           "carries only the PLE families; the log line is the report."),
)
