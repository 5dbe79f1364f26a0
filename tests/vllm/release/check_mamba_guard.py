"""Patch 3 (Mamba state-copy bounds guard) against the release's real `mamba_utils.py`.

- In this session (Triton importable, kernels are real `JITFunction`s): the patch applied by
  register() replaced the three kernels and the four context methods, is idempotent, its anchors
  fail loudly when the release's source moves, and Triton's real compiler takes the guarded
  kernels to sm_121 (GB10) cubin on this CPU-only machine.
- In a subprocess with `TRITON_INTERPRET=1` (so the interpreter mode never leaks into the other
  checks): mamba_guard_interp.py runs the stock and the patched kernels for real on CPU tensors
  through a real `MambaSpecDecodeGPUContext`; in-range copies are byte-identical to the stock
  kernels', out-of-range ids and columns skip exactly their copies and count them.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def interp():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(HERE / "mamba_guard_interp.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


def _ctx():
    from flash_vllm import compat
    from flash_vllm.registry import Context

    return Context(compat.resolve(compat.installed_vllm_version(), {}), {})


def test_installed_on_the_real_kernels_and_idempotent(registered):
    from vllm.v1.worker import mamba_utils as mu

    from flash_vllm.patches import p03_mamba_copy_guard as g
    from flash_vllm.registry import by_number

    assert 3 in registered["applied"]
    kernels = [getattr(mu, n) for n in (g.COPY, *g.CALLERS)]
    before = kernels + [inspect.getattr_static(mu.MambaSpecDecodeGPUContext, n)
                        for n in (*g.LAUNCHERS, g.POPULATE)]
    for k in kernels:
        assert type(k).__name__ == "JITFunction" and k.__flash_patch__ == 3
        assert type(k.__flash_original__).__name__ == "JITFunction"
        params = inspect.signature(k.fn).parameters
        assert list(params)[list(params).index("state_dim_row_stride_ptr") + 1:][:2] == list(g.GUARD_ARGS)
    assert "tl.atomic_add(guard_counter_ptr, 1)" in mu._copy_mamba_state_block.src
    assert "atomic_add" not in mu._copy_mamba_state_block.__flash_original__.src
    # the callers' guarded copy body is the installed one (same namespace)
    assert mu.postprocess_mamba_fused_kernel.fn.__globals__[g.COPY] is mu._copy_mamba_state_block
    patch, ctx = by_number(3), _ctx()
    patch.check(ctx)
    patch.apply(ctx)
    patch.verify(ctx)
    after = [getattr(mu, n) for n in (g.COPY, *g.CALLERS)] + [
        inspect.getattr_static(mu.MambaSpecDecodeGPUContext, n) for n in (*g.LAUNCHERS, g.POPULATE)]
    assert all(a is b for a, b in zip(before, after))


# int64 pointers of the launchers (the context's metadata tensors); every other *_ptr is int32
I64_PTRS = {"block_table_ptrs_ptr", "state_base_addrs_ptr", "state_block_strides_ptr",
            "state_inner_sizes_ptr", "state_dim_row_stride_ptr", "state_num_blocks_ptr"}


@pytest.mark.parametrize("kernel,consts", [
    # V1 postprocess (idx_mapping None, SD conv layout) and V2 precopy (idx mapping, DS layout)
    ("postprocess_mamba_fused_kernel",
     {"idx_mapping_ptr": None, "block_size": 1600, "COPY_BLOCK_SIZE": 1024, "CONV_STATE_DIM_FIRST": False,
      "HAS_IDX_MAPPING": False, "PRECOMPUTED_NEW_COMPUTED": False, "TEMPORAL_TILES": 16}),
    ("precopy_mamba_align_fused_kernel",
     {"COPY_BLOCK_SIZE": 1024, "CONV_STATE_DIM_FIRST": True, "HAS_IDX_MAPPING": True, "TEMPORAL_TILES": 16}),
])
def test_guarded_kernels_compile_for_gb10(registered, kernel, consts):
    """The real Triton compiler (no GPU needed) takes the guarded kernels to sm_121 cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm.v1.worker import mamba_utils as mu

    k = getattr(mu, kernel)
    assert k.__flash_patch__ == 3
    sig = {}
    for name in inspect.signature(k.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name in I64_PTRS:
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*i32"
        else:
            sig[name] = {"block_table_stride_req": "i64", "num_reqs": "i32"}[name]
    out = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts),
                         target=GPUTarget("cuda", 121, 32))
    assert out.asm["cubin"] and "atom.global" in out.asm["ptx"]


@pytest.mark.parametrize("target,mutate,match", [
    ("_copy_mamba_state_block", lambda s: s.replace("    tile_idx,\n", "    tile,\n", 1), "exactly one"),
    ("_copy_mamba_state_block",
     lambda s: s.replace("    is_conv_state = conv_width > 0\n",
                         "    is_conv_state = conv_width > 0\n    x = tl.load(block_table_base + 7)\n"),
     "tl.load\\(block_table_base"),
    ("_copy_mamba_state_block", lambda s: s.replace("return\n", "tl.atomic_add(p, 1)\n    return\n", 1),
     "fixed upstream"),
    ("_copy_mamba_state_block", lambda s: s.replace("memmove-safe", "safe"), "memmove-safe"),
    ("precopy_mamba_align_fused_kernel", lambda s: s.replace("state_dim_row_stride_ptr,", "rows,"),
     "exactly one"),
    ("MambaSpecDecodeGPUContext.run_fused_postprocess_align",
     lambda s: s.replace("self.state_dim_row_stride,", "self.state_dim_row_stride, x,"), "exactly one"),
    ("MambaSpecDecodeGPUContext._populate_metadata",
     lambda s: s.replace("self.is_initialized = True", "self.ready = True"), "exactly one"),
])
def test_check_fails_loudly_when_the_release_changes(registered, monkeypatch, target, mutate, match):
    from flash_vllm.patches import p03_mamba_copy_guard as g
    from flash_vllm.registry import TargetMissing

    real = g._source
    monkeypatch.setattr(g, "_source", lambda q: mutate(real(q)) if q == target else real(q))
    assert mutate(real(target)) != real(target)
    with pytest.raises(TargetMissing, match=match):
        g.check(_ctx())


def test_kill_switch_leaves_the_release_alone():
    from flash_vllm import plugin
    from flash_vllm.registry import Context

    base = _ctx().base
    actions = {p.number: a for p, a in plugin.plan(Context(base, {"FLASH_DISABLE_PATCHES": "3"}))}
    assert actions[3] == "off"
    assert {p.number: a for p, a in plugin.plan(Context(base, {}))}[3] == "apply"


def test_interpreter_runs_the_stock_and_the_guarded_kernels(interp):
    assert interp["triton_interpret"] == "1"
    assert interp["stock_kernel"] == interp["patched_kernel"] == "InterpretedFunction"
    assert interp["patched_src_has_guard"]
    # the stock kernels did copy (so "identical" below is not two no-ops)
    assert len(interp["stock_changed"]["good_pre"]) >= 6 and len(interp["stock_changed"]["good_post"]) >= 8


def test_in_range_copies_are_byte_identical_to_stock(interp):
    for name in ("good_pre", "good_post"):
        run = interp[name]
        assert run["identical_to_stock"], name
        assert run["mismatch"] == [] and run["checked"] == 2 * (16 + 12)
        assert run["counter"] == 0
        assert run["changed"] == interp["stock_changed"][name]
    assert interp["good_post"]["accepted_out"] == interp["good_post"]["stock_accepted_out"]


def test_out_of_range_ids_skip_their_copies_and_count(interp):
    for name in ("pre", "post"):
        run = interp[name]
        assert run["num_blocks"] == [16, 16, 12, 12]  # per state pool, from the real _populate_metadata
        assert run["mismatch"] == [], (name, run)
        assert run["counter"] == interp["want_counter"][name]
        assert not run["identical_to_stock"]  # the bad requests' stand-in copies did not happen
    # the conv copies of a request whose temporal source column is past the row still happen
    assert [0, 0, 12] in interp["pre"]["changed"] and [0, 1, 12] not in interp["pre"]["changed"]
    assert interp["post"]["accepted_out"][:3] == interp["post"]["stock_accepted_out"]


def test_counter_is_reported_once_per_increase(interp):
    assert interp["report_early"] == []
    assert interp["report_lines"] == [
        "mamba state-copy guard: 4 out-of-range (state copies skipped; +4 since the last report)"]
