"""flash_cli.plan.kvcache against vLLM's own allocator code, inside a release venv.

The planner re-derives vLLM's hybrid KV accounting in plain Python (no vLLM on the host). Here the
same per-layer specs are built with the release's real classes (FullAttentionSpec,
MLAAttentionSpec, CircularBufferSpec, MambaSpec) and handed to the release's own
`get_kv_cache_groups`, `get_kv_cache_config_from_groups` and
`get_max_concurrency_for_kv_cache_config`; groups, bytes per block, blocks and the logged token
count must agree exactly. The block size is checked against the release's
`Platform._align_hybrid_block_size`, run on stubs of the model class and the QSA backend.
Run by tests/vllm/test_releases.py in each release venv; by hand:
`PYTHONPATH=<release site>:src python -m pytest tests/vllm/release/check_plan_kv.py -o python_files=check_*.py`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flash_cli.geometry import REAL
from flash_cli.plan.kvcache import layout

CASES = [
    dict(mtp=0, kv_dtype="auto", prefix_cache=True, max_model_len=262_144),
    dict(mtp=2, kv_dtype="auto", prefix_cache=True, max_model_len=500_000),
    dict(mtp=3, kv_dtype="auto", prefix_cache=True, max_model_len=1_000_000),
    dict(mtp=2, kv_dtype="fp8_e4m3", prefix_cache=True, max_model_len=1_000_000),
    dict(mtp=2, kv_dtype="auto", prefix_cache=False, max_model_len=500_000),
]


def release_base() -> str:
    try:
        from importlib.metadata import version

        v = version("vllm")
    except Exception:  # a source tree on PYTHONPATH has no dist-info
        from vllm.version import __version__ as v
    major, minor = v.split(".")[:2]
    return f"v{major}.{minor}"


def release_planning():
    """The module holding this release's KV planning functions (0.33 moved them out of kv_cache_utils)."""
    from vllm.v1.core import kv_cache_utils as ku

    if hasattr(ku, "get_kv_cache_groups"):
        return ku
    from vllm.v1.core import kv_cache_planning

    return kv_cache_planning


def vllm_specs(ours, torch, iface, checkpoints: bool, g=REAL):
    """Our Spec list → the release's spec objects, field by field as the layers build them (for the
    geometry `ours` was laid out with: the real model's unless told)."""
    out = {}
    kv_dtype = torch.float8_e4m3fn if ours.kv_dtype_bytes == 1 else torch.bfloat16
    quant = iface.get_kv_quant_mode("fp8_e4m3" if ours.kv_dtype_bytes == 1 else "auto")
    conv = (g.gdn_conv_dim, g.linear_conv_kernel_dim - 1 + ours.num_spec)
    ssm = (g.linear_num_value_heads, g.linear_value_head_dim, g.linear_key_head_dim)
    ple = (g.hc_width, g.ple_conv_state_len + ours.num_spec)
    mode = "align" if ours.prefix_cache else "none"
    # 0.33 + FlashInfer GDN prefill: every Mamba layer exports prefill checkpoints (one more block)
    ckpt = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=ours.block_size) if checkpoints else {}
    for s in ours.specs:
        if s.label == "qsa_kv":
            spec = iface.FullAttentionSpec(block_size=s.block_size, num_kv_heads=g.num_key_value_heads,
                                           head_size=g.head_dim, head_size_v=g.head_dim, dtype=kv_dtype,
                                           kv_quant_mode=quant)
        elif s.label == "qsa_index_keys":
            spec = iface.MLAAttentionSpec(block_size=s.block_size, num_kv_heads=1, head_size=g.indexer_head_dim,
                                          dtype=torch.bfloat16, tokens_per_state=g.indexer_compress_ratio)
        elif s.label == "qsa_ring":
            spec = iface.CircularBufferSpec(block_size=s.block_size, num_kv_heads=1,
                                            head_size=g.indexer_head_dim + 12, head_size_v=0, dtype=torch.bfloat16)
        elif s.label == "gdn_state":
            spec = iface.MambaSpec(shapes=(conv, ssm), dtypes=(torch.bfloat16, torch.float32), block_size=s.block_size,
                                   page_size_padded=s.page, mamba_cache_mode=mode, num_speculative_blocks=ours.num_spec, **ckpt)
        else:
            spec = iface.MambaSpec(shapes=(ple,), dtypes=(torch.bfloat16,), block_size=s.block_size,
                                   page_size_padded=s.page, mamba_cache_mode=mode, num_speculative_blocks=ours.num_spec,
                                   tp_replicated=True, **ckpt)
        assert spec.page_size_bytes == s.page, (s.layer, spec.page_size_bytes, s.page)
        out[s.layer] = spec
    return out


def fake_config(max_model_len: int, prefix_cache: bool):
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len, hf_config=SimpleNamespace(model_type="qwen4_exp")),
        cache_config=SimpleNamespace(kv_cache_layout="BLNHC", mamba_cache_mode="align" if prefix_cache else "none",
                                     num_gpu_blocks_override=None, prefix_cache_retention_interval=None,
                                     get_resolved_kv_cache_layout=lambda: __import__(
                                         "vllm.v1.kv_cache_layout", fromlist=["KVCacheLayout"]).KVCacheLayout.BLNHC),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
    )


@pytest.mark.parametrize("case", CASES, ids=[f"mtp{c['mtp']}-{c['kv_dtype']}-pc{int(c['prefix_cache'])}" for c in CASES])
def test_groups_blocks_and_tokens_match_vllm(case):
    torch = pytest.importorskip("torch")
    import vllm.v1.kv_cache_interface as iface
    from vllm.v1.core import kv_cache_utils as ku

    planning = release_planning()
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    base = release_base()
    ours = layout(REAL, base=base, **case)  # flashinfer_gdn=True: the sm_121 + CUDA 13 selection
    checkpoints = ours.checkpoints
    cfg = fake_config(case["max_model_len"], case["prefix_cache"])
    register_all_kvcache_specs(cfg)
    specs = vllm_specs(ours, torch, iface, checkpoints)
    groups = planning.get_kv_cache_groups(cfg, dict(specs))
    theirs = sorted(sorted(g.layer_names) for g in groups)
    assert theirs == sorted(sorted(s.layer for s in g.layers) for g in ours.groups)
    available = 19 * 1024**3 + 12345
    kv_cfg = planning.get_kv_cache_config_from_groups(cfg, groups, available)
    assert kv_cfg.num_blocks == ours.num_blocks(available)
    assert kv_cfg.num_blocks == available // ours.bytes_per_block
    concurrency = ku.get_max_concurrency_for_kv_cache_config(cfg, kv_cfg)
    assert concurrency == pytest.approx(ours.concurrency(available), rel=1e-12)
    assert int(concurrency * case["max_model_len"]) == ours.tokens(available)


BLOCK_CASES = [(0, "auto", True), (2, "auto", True), (3, "auto", True), (2, "fp8_e4m3", True), (2, "auto", False)]


@pytest.mark.parametrize("mtp, kv_dtype, prefix_cache", BLOCK_CASES, ids=[f"mtp{m}-{d}-pc{int(p)}" for m, d, p in BLOCK_CASES])
def test_block_size_matches_align_hybrid_block_size(monkeypatch, mtp, kv_dtype, prefix_cache):
    """Platform._align_hybrid_block_size run on stubs of what it asks: the model class (Mamba specs
    of GDN + PLE, as `get_mamba_specs_from_config` builds them) and the QSA backend (kernel block
    MultipleOf(16)); on 0.33 the prefill-checkpoint alignment of FlashInfer's GDN prefill (64)."""
    torch = pytest.importorskip("torch")
    import vllm.platforms.interface as pi
    import vllm.v1.kv_cache_interface as iface
    from vllm.v1.attention.backend import MultipleOf

    base = release_base()
    ours = layout(REAL, base=base, kv_dtype=kv_dtype, mtp=mtp, prefix_cache=prefix_cache, max_model_len=500_000)
    g = REAL

    class Model:
        @staticmethod
        def get_mamba_specs_from_config(_cfg):
            return (iface.MambaSpec(shapes=((g.gdn_conv_dim, g.linear_conv_kernel_dim - 1 + mtp),
                                            (g.linear_num_value_heads, g.linear_value_head_dim, g.linear_key_head_dim)),
                                    dtypes=(torch.bfloat16, torch.float32), block_size=-1),
                    iface.MambaSpec(shapes=((g.hc_width, g.ple_conv_state_len + mtp),), dtypes=(torch.bfloat16,),
                                    block_size=-1, tp_replicated=True))

    class Backend:
        @staticmethod
        def get_supported_kernel_block_sizes():
            return [MultipleOf(16)]

        @classmethod
        def customize_spec(cls, spec):
            return spec

    from vllm.model_executor.models import ModelRegistry

    monkeypatch.setattr(ModelRegistry, "resolve_model_cls", lambda *a, **k: (Model, "Qwen4ExpForConditionalGeneration"))
    if hasattr(pi.Platform, "_find_non_ssm_backends"):
        monkeypatch.setattr(pi.Platform, "_find_non_ssm_backends", classmethod(lambda cls, cfg: [Backend]))
    import vllm.model_executor.layers.mamba.abstract as ab

    if hasattr(ab, "get_mamba_prefill_checkpoint_alignment"):
        monkeypatch.setattr(ab, "get_mamba_prefill_checkpoint_alignment",
                            lambda cfg: 64 if ours.checkpoints else None)
    cache = SimpleNamespace(cache_dtype=kv_dtype, block_size=16, user_specified_block_size=False,
                            user_specified_mamba_block_size=False, mamba_block_size=None,
                            mamba_cache_mode="align" if prefix_cache else "none", mamba_page_size_padded=None,
                            kv_cache_dtype_skip_layers=None)
    model = SimpleNamespace(use_mla=False, dtype=torch.bfloat16, architecture="Qwen4ExpForConditionalGeneration",
                            get_num_kv_heads=lambda pc: g.num_key_value_heads, get_head_size=lambda: g.head_dim)
    cfg = SimpleNamespace(cache_config=cache, model_config=model, parallel_config=SimpleNamespace())
    monkeypatch.setattr(pi, "set_current_vllm_config", lambda c: __import__("contextlib").nullcontext(), raising=False)
    import vllm.config.vllm as cv

    monkeypatch.setattr(cv, "set_current_vllm_config", lambda c: __import__("contextlib").nullcontext())
    pi.Platform._align_hybrid_block_size(cfg, Backend)
    assert cache.block_size == ours.block_size
    assert cache.mamba_page_size_padded == ours.block_size * ours.attn_page_per_token
