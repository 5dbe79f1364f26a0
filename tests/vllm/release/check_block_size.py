"""Patch 4 with the real vLLM methods: the scheduler's aligned split and the Mamba seed index.

A hybrid config as 0.29 leaves it after EngineCore: `cache_config.block_size` = 8 (the QSA
ring's block) while Mamba state slots are `mamba_block_size` = 1600 tokens apart.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

RING, MAMBA = 8, 1600


class FakeSchedulerState:
    """The attributes `Scheduler._mamba_block_aligned_split` reads (superset across releases)."""

    def __init__(self):
        self.cache_config = SimpleNamespace(block_size=RING, mamba_block_size=MAMBA)
        self.block_size = MAMBA  # the scheduler's own block: LCM of the groups
        self.hash_block_size = MAMBA
        self.mamba_has_prefill_checkpoint_blocks = False
        self.mamba_partial_cache_hit = False
        self.mamba_fine_grained_prefix_cache = False
        self.mamba_prefill_checkpoint_alignment = MAMBA
        self.mamba_shared_prefix_checkpoint = False
        self.max_num_scheduled_tokens = 8192
        self.scheduler_config = SimpleNamespace(long_prefill_token_threshold=0)
        self.use_eagle = False
        self.use_eagle_block_drop = False
        self.num_hash_lookahead_tokens = 0


def _request(prompt: int, computed: int = 0):
    return SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt, num_tokens=prompt,
                           shared_prefix_boundary=0)


def test_aligned_split_ends_chunks_on_mamba_blocks(registered):
    from vllm.v1.core.sched.scheduler import Scheduler

    split = Scheduler._mamba_block_aligned_split
    assert split.__flash_patch__ == 4
    state = FakeSchedulerState()
    # 10,000-token prompt, a 4,000-token chunk from 0: must stop at 3,200 (2 Mamba blocks)
    patched = split(state, _request(10_000), 4000)
    stock = split.__flash_original__(state, _request(10_000), 4000)
    assert patched == 3200
    assert stock % RING == 0 and stock != patched  # the bug: aligned to the ring's 8 tokens
    assert state.cache_config.block_size == RING   # the view is gone after the call
    # resumed mid-prompt at a Mamba boundary: 3,200 + 5,000 -> ends at 8,000 (5 blocks)
    assert split(state, _request(10_000, computed=3200), 5000) == 8000 - 3200
    # identity when the sizes agree (0.30+ normally)
    state.cache_config.block_size = MAMBA
    assert split(state, _request(10_000), 4000) == split.__flash_original__(state, _request(10_000), 4000)


def _model_state():
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    st = object.__new__(MambaHybridModelState)
    st.cache_config = SimpleNamespace(block_size=RING, mamba_block_size=MAMBA, mamba_cache_mode="align")
    st.rope_state = None
    st.prompt_embeds_state = None
    st.num_accepted_tokens_gpu = torch.zeros(4, dtype=torch.int32)
    st._align_mode = True
    st._mamba_state_idx_gpu = torch.zeros(4, dtype=torch.int32)
    return st


def test_mamba_seed_index_uses_mamba_block(registered, base):
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    st = _model_state()
    req = SimpleNamespace(num_computed_tokens=3200, prefill_token_ids=[1] * 3201, mm_features=[])
    MambaHybridModelState.add_request(st, 2, req)
    # after 3,200 computed tokens the running state is slot (3200 - 1) // 1600 = 1
    assert int(st._mamba_state_idx_gpu[2]) == 1
    assert int(st.num_accepted_tokens_gpu[2]) == 1
    assert st.cache_config.block_size == RING
    fn = MambaHybridModelState.add_request
    from flash_vllm.patches.p04_mamba_block_size import SEED_FIXED_IN

    if base not in SEED_FIXED_IN:  # patch 4's declared range: the seed fix is upstream from 0.32
        assert fn.__flash_patch__ == 4
        stock = _model_state()
        fn.__flash_original__(stock, 2, req)
        assert int(stock._mamba_state_idx_gpu[2]) == 3199 // RING  # the null-block column
    else:
        assert not hasattr(fn, "__flash_patch__")  # fixed upstream in 0.32


def test_boot_line_states_both_block_sizes(registered):
    from vllm.v1.engine.core import EngineCore

    fn = EngineCore._initialize_kv_caches
    assert fn.__flash_patch__ == 4
    import logging

    records = []
    h = logging.Handler()
    h.emit = records.append
    log = logging.getLogger("vllm.flash")
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=RING, mamba_block_size=MAMBA))
        wrapped = fn.__wrapped__ if hasattr(fn, "__wrapped__") else None
        assert wrapped is None
        # run the wrapper around a stand-in for the heavy upstream body
        from flash_vllm.patches.p04_mamba_block_size import _log_sizes

        out = _log_sizes(lambda self, c: "kv")(None, cfg)
    finally:
        log.removeHandler(h)
    assert out == "kv"
    line = records[-1].getMessage()
    assert "block_size=8" in line and "mamba_block_size=1600" in line and "differ" in line
