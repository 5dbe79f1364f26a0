"""Patch 4: Mamba prefix-caching block size (+ a boot line stating both block sizes).

0.29's EngineCore sets `cache_config.block_size` to the smallest KV group block, which is the
QSA raw-key ring (4 or 8 tokens), while Mamba state slots are `mamba_block_size` (e.g. 1600)
apart. Two consumers then index Mamba state with the wrong block: the model state seeds the
running slot at `(computed - 1) // block_size` (a column past the row: the null block, an
all-zero state "restored" on every prefix hit) and the scheduler aligns prefill chunks to 4/8
tokens instead of 1600. Both are evaluated here against the Mamba block size.

0.30+ computes the minimum over prefix-cacheable groups only, so the ring no longer drags it
down; 0.32 fixed the model-state seed. A drafter group with a smaller block can still pull
`cache_config.block_size` below the Mamba block on every release (0.32's own comment), so the
scheduler half stays on as a safety: it is the identity whenever the two sizes agree.
"""

from __future__ import annotations

import logging

from flash_common import releases

from ...registry import Context, Gate, Patch, expect_installed, expect_source, install

NUMBER = 4
SCHED = ("vllm.v1.core.sched.scheduler", "Scheduler._mamba_block_aligned_split")
STATE = ("vllm.v1.worker.gpu.model_states.mamba_hybrid", "MambaHybridModelState.add_request")
CORE = ("vllm.v1.engine.core", "EngineCore._initialize_kv_caches")
SEED_FIXED_IN = releases.upstream_from("0.32.0")  # add_request uses mamba_block_size upstream
log = logging.getLogger("vllm.flash")


class BlockSizeView:
    """`cache_config` as the wrapped method should have seen it: `block_size` = the Mamba block."""

    __slots__ = ("_real", "block_size")

    def __init__(self, real, block_size: int):
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "block_size", block_size)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __setattr__(self, name, value):
        setattr(self._real, name, value)


def mamba_block(cache_config, fallback: int) -> int:
    mbs = getattr(cache_config, "mamba_block_size", None)
    return int(mbs) if mbs else int(fallback)


def _with_view(orig, fallback_attr: str | None):
    def wrapper(self, *args, **kwargs):
        real = self.cache_config
        fallback = getattr(self, fallback_attr) if fallback_attr else real.block_size
        size = mamba_block(real, fallback)
        if size == real.block_size:
            return orig(self, *args, **kwargs)
        self.cache_config = BlockSizeView(real, size)
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.cache_config = real

    wrapper.__name__, wrapper.__doc__, wrapper.__qualname__ = orig.__name__, orig.__doc__, orig.__qualname__
    return wrapper


def _log_sizes(orig):
    def _initialize_kv_caches(self, vllm_config, *args, **kwargs):
        result = orig(self, vllm_config, *args, **kwargs)
        cc = vllm_config.cache_config
        mbs = getattr(cc, "mamba_block_size", None)
        log.info("flash_vllm: cache_config.block_size=%s mamba_block_size=%s%s", cc.block_size, mbs,
                 "" if mbs in (None, cc.block_size) else
                 " (differ: patch 4 evaluates Mamba state and prefill alignment at mamba_block_size)")
        return result

    _initialize_kv_caches.__doc__ = orig.__doc__
    return _initialize_kv_caches


def check(ctx: Context) -> None:
    expect_source(*SCHED, "block_size = self.cache_config.block_size")
    expect_source(*CORE, "cache_config.block_size = min(")
    if ctx.base.name in SEED_FIXED_IN:
        expect_source(*STATE, "// mamba_block_size")
    else:
        expect_source(*STATE, "(new_req_data.num_computed_tokens - 1) // self.cache_config.block_size")


def apply(ctx: Context) -> None:
    install(NUMBER, *SCHED, lambda orig: _with_view(orig, "block_size"))
    install(NUMBER, *CORE, _log_sizes)
    if ctx.base.name not in SEED_FIXED_IN:
        install(NUMBER, *STATE, lambda orig: _with_view(orig, None))


def verify(ctx: Context) -> None:
    expect_installed(NUMBER, *SCHED)
    expect_installed(NUMBER, *CORE)
    if ctx.base.name not in SEED_FIXED_IN:
        expect_installed(NUMBER, *STATE)


PATCH = Patch(
    number=NUMBER,
    name="mamba-block-size",
    title="Prefix caching: Mamba block size for state seed and chunk alignment",
    why=("0.29 shrinks cache_config.block_size to the QSA ring's 4/8 tokens; the Mamba state "
         "seed then reads the null block (all-zero state on a prefix hit) and prefill chunks align "
         "to 4/8 tokens. Evaluated at mamba_block_size; a safety on 0.30+ (identity when the sizes "
         "agree). Logs both sizes at boot. On 0.29 it changes greedy output: a correction, not a "
         "neutral patch there (run41; the gpu-e2e tier's fix_p4)."),
    upstream="0.30 core.py (min over prefix-cacheable groups); 0.32 mamba_hybrid.add_request",
    gate=Gate.always("always on (identity when block sizes agree)"),
    targets=tuple(f"{m}:{q}" for m, q in (SCHED, STATE, CORE)),
    applies_to=releases.since("0.29.0"),
    check=check, apply=apply, verify=verify,
    notes="The model-state half is installed on v0.29-v0.31 only (fixed upstream in 0.32).",
)
