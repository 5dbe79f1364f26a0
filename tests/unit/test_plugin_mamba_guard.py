"""Patch 3 (Mamba state-copy bounds guard): registry entry and the source rewrite, without vLLM.

A miniature `vllm.v1.worker.mamba_utils` (loaded from a file, so its source is readable) carries
the anchors the patch relies on; its `triton.jit` records launches instead of compiling. The real
kernels of every release run in tests/vllm/release/check_mamba_guard.py (Triton interpreter).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from flash_vllm import compat, plugin
from flash_vllm.registry import Context, TargetMissing, by_number

MINI = '''
class _Kernel:
    def __init__(self, fn):
        self.fn = fn
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, args, kw))


class _Triton:
    def jit(self, fn=None, **options):
        return _Kernel(fn) if fn is not None else _Kernel


triton = tl = _Triton()


@triton.jit
def _copy_mamba_state_block(
    state_idx,
    src_col,
    dst_col,
    token_bias,
    block_table_base,
    block_table_stride_req,
    state_dim_row_stride_ptr,
    tile_idx,
):
    conv_width = tl.load(state_idx)
    dest_block_id = tl.load(block_table_base + dst_col).to(tl.int64)
    is_conv_state = conv_width > 0
    if is_conv_state:
        # Stable row-to-lane ownership makes left shifts memmove-safe
        src_block_id = tl.load(block_table_base + src_col).to(tl.int64)
        if src_block_id != dest_block_id or token_bias == 0:
            return
        src_block_id = tl.load(block_table_base + src_col).to(tl.int64)
        return
    actual_src_block_id = tl.load(block_table_base + src_col + token_bias).to(tl.int64)


@triton.jit(do_not_specialize=["num_reqs"])
def postprocess_mamba_fused_kernel(
    block_table_stride_req,
    state_dim_row_stride_ptr,  # int64: bytes between rows for DS conv
    num_reqs,
):
    _copy_mamba_state_block(
        block_table_stride_req,
        state_dim_row_stride_ptr,
        num_reqs,
    )


@triton.jit(do_not_specialize=["num_reqs"])
def precopy_mamba_align_fused_kernel(
    block_table_stride_req,
    state_dim_row_stride_ptr,
    num_reqs,
):
    _copy_mamba_state_block(
        block_table_stride_req,
        state_dim_row_stride_ptr,
        num_reqs,
    )


class MambaSpecDecodeGPUContext:
    block_table_stride_req = 5
    state_dim_row_stride = "rows"

    def run_fused_postprocess(self, num_reqs):
        grid = (num_reqs, 1)
        postprocess_mamba_fused_kernel[grid](
            self.block_table_stride_req,
            self.state_dim_row_stride,
            num_reqs,
        )

    def run_fused_precopy(self, num_reqs):
        grid = (num_reqs, 1)
        precopy_mamba_align_fused_kernel[grid](
            self.block_table_stride_req,
            self.state_dim_row_stride,
            num_reqs,
        )

    def run_fused_postprocess_align(self, num_reqs):
        grid = (num_reqs, 1)
        postprocess_mamba_fused_kernel[grid](
            self.block_table_stride_req,
            self.state_dim_row_stride,
            num_reqs,
        )

    def _populate_metadata(self, states):
        self.state_elem_sizes = {}
        for idx, state in enumerate(states):
            self.state_elem_sizes[idx] = state.element_size()
        self.is_initialized = True
'''


class FakeGuard:
    def __init__(self):
        self.records, self.published, self.polls = [], 0, 0
        self.num_blocks, self.counter = "NUM_BLOCKS", "COUNTER"

    def record(self, idx, state):
        self.records.append((idx, state.shape[0]))

    def publish(self):
        self.published += 1

    def poll(self):
        self.polls += 1


@pytest.fixture()
def mini(tmp_path, monkeypatch):
    def load(text=MINI):
        path = tmp_path / "mini_mamba_utils.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location("vllm.v1.worker.mamba_utils", path)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "vllm.v1.worker.mamba_utils", mod)
        spec.loader.exec_module(mod)
        return mod

    return load


def _ctx(env=None):
    return Context(compat.resolve("0.33.0", {}), env or {})


def test_registry_entry_always_on_everywhere_with_kill_switch():
    p = by_number(3)
    assert p.name == "mamba-copy-guard" and p.gate.env is None
    assert all(p.expected_status(b) == "applies" for b in compat.ORDER)
    assert p.enabled({}) and not p.enabled({"FLASH_DISABLE_PATCHES": "3"})
    actions = {q.number: a for q, a in plugin.plan(_ctx({"FLASH_DISABLE_PATCHES": "12,3"}))}
    assert actions[3] == "off" and actions[4] == "apply"
    assert "50729" in p.upstream and len(p.targets) == 7


def test_rewrite_threads_the_guard_through_kernels_and_launchers(mini):
    from flash_vllm.patches import p03_mamba_copy_guard as g

    mini()
    src = g.rewritten_sources()
    copy = src[g.COPY]
    assert copy.count("# --- flash patch 3 begin") == 1
    # the guard sits before the first block-id load, and the release's own lines follow unchanged
    assert copy.index("tl.atomic_add(guard_counter_ptr, 1)") < copy.index("dest_block_id = tl.load(")
    assert "    state_dim_row_stride_ptr,\n    state_num_blocks_ptr,\n    guard_counter_ptr,\n    tile_idx,\n" in copy
    for name in g.CALLERS:
        assert src[name].count("state_num_blocks_ptr,") == 2 and src[name].count("guard_counter_ptr,") == 2
    for name in g.LAUNCHERS:
        assert src[f"{g.CTX}.{name}"].count("*_flash_mamba_guard_args(self),") == 1
    pop = src[f"{g.CTX}.{g.POPULATE}"]
    assert pop.index(".record(idx, state)") < pop.index(".publish()") < pop.index("self.is_initialized = True")


def test_apply_installs_launches_with_guard_args_and_is_idempotent(mini):
    from flash_vllm.patches import p03_mamba_copy_guard as g

    mod = mini()
    patch, ctx = by_number(3), _ctx()
    patch.check(ctx)
    patch.apply(ctx)
    patch.verify(ctx)
    first = [mod._copy_mamba_state_block, mod.postprocess_mamba_fused_kernel,
             mod.MambaSpecDecodeGPUContext.run_fused_precopy]
    patch.apply(ctx)
    patch.check(ctx)
    assert first == [mod._copy_mamba_state_block, mod.postprocess_mamba_fused_kernel,
                     mod.MambaSpecDecodeGPUContext.run_fused_precopy]
    # the callers' copy body is the guarded one
    assert mod.precopy_mamba_align_fused_kernel.fn.__globals__[g.COPY] is mod._copy_mamba_state_block

    c = mod.MambaSpecDecodeGPUContext()
    with pytest.raises(RuntimeError, match="before the guard's block counts"):
        c.run_fused_precopy(3)
    guard = c._flash_mamba_guard = FakeGuard()
    states = [types.SimpleNamespace(shape=(n, 4), element_size=lambda: 2) for n in (16, 12)]
    c._populate_metadata(states)
    assert guard.records == [(0, 16), (1, 12)] and guard.published == 1 and c.is_initialized
    c.run_fused_precopy(3)
    c.run_fused_postprocess(2)
    c.run_fused_postprocess_align(1)
    assert mod.precopy_mamba_align_fused_kernel.launches == [((3, 1), (5, "rows", "NUM_BLOCKS", "COUNTER", 3), {})]
    assert [launch[1] for launch in mod.postprocess_mamba_fused_kernel.launches] == [
        (5, "rows", "NUM_BLOCKS", "COUNTER", 2), (5, "rows", "NUM_BLOCKS", "COUNTER", 1)]
    assert guard.polls == 3


@pytest.mark.parametrize("old,new,match", [
    ("    dest_block_id = tl.load", "    dst_id = tl.load", "expected 1 x"),
    ("        return\n    actual", "        return\n    x = tl.load(block_table_base + 1)\n    actual",
     "tl.load\\(block_table_base"),
    ("memmove-safe", "safe", "memmove-safe"),
    ("    conv_width = tl.load(state_idx)\n", "    conv_width = tl.load(state_idx)\n    tl.atomic_add(x, 1)\n",
     "fixed upstream"),
    ("            self.state_dim_row_stride,\n            num_reqs,\n        )\n\n    def run_fused_precopy",
     "            num_reqs,\n        )\n\n    def run_fused_precopy", "run_fused_postprocess: expected exactly one"),
    ("        self.is_initialized = True\n", "", "_populate_metadata \\(end\\)"),
])
def test_check_fails_loudly_when_an_anchor_moves(mini, old, new, match):
    assert MINI.count(old) == 1
    mini(MINI.replace(old, new))
    with pytest.raises(TargetMissing, match=match):
        by_number(3).check(_ctx())


def test_partly_installed_is_refused(mini):
    from flash_vllm.patches import p03_mamba_copy_guard as g
    from flash_vllm.registry import install

    mini()
    new = g.build()
    install(3, g.MOD, g.COPY, lambda orig: new[g.COPY])
    with pytest.raises(TargetMissing, match="only partly installed"):
        by_number(3).check(_ctx())
