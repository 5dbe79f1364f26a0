"""Patch 2: the FLA shared-memory gate and the chunk_delta_h warp pin, on the real modules."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("smem, arch, expected", [
    (101_376, "none", True),     # GB10 / sm_121: 99 KiB now passes the default gate
    (101_375, "none", False),
    (102_400, "none", True),
    (166_911, "ampere", False),  # named arches keep their thresholds
    (232_448, "hopper", True),
])
def test_shared_memory_gate(registered, monkeypatch, smem, arch, expected):
    import vllm.third_party.flash_linear_attention.ops.utils as u

    monkeypatch.setattr(u, "get_all_max_shared_mem", lambda: [smem])
    gate = u.check_shared_mem
    assert gate.__flash_patch__ == 2
    gate.cache_clear()
    try:
        assert gate(arch) is expected
    finally:
        gate.cache_clear()
    stock = gate.__flash_original__
    stock.cache_clear()
    try:
        assert stock(arch) is (smem >= u.Backend.get_shared_memory(arch))
    finally:
        stock.cache_clear()


def test_chunk_delta_h_autotunes_num_warps_2_only(registered):
    from vllm.third_party.flash_linear_attention.ops import chunk_delta_h

    from flash_vllm.patches.p02_fla_sm121 import autotuner

    tuner = autotuner(chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
    warps = [c.num_warps for c in tuner.configs]
    assert warps and set(warps) == {2}
    # every (BV, num_stages) combination of the stock list survives, only num_warps=4 is gone
    assert len({(c.kwargs["BV"], c.num_stages) for c in tuner.configs}) == len(warps)
