"""Patch 7: fp8 (e4m3) KV cache on QSA layers, with the release's real classes on CPU.

On 0.29/0.30 the patch is ours (check, apply twice, verify); on 0.31+ the same checks run against
vLLM's native code, so every release is held to the same behaviour:

- the stock 0.29/0.30 layer refuses fp8 ("requires a BF16 main KV cache"); with the patch (or
  natively) `Qwen4ExpQSAAttention` builds with `--kv-cache-dtype fp8|fp8_e4m3`, its impl keeps the
  fp8 dtype, and `get_kv_cache_spec` is a uint8 `FullAttentionSpec` with the fp8 quant mode;
  bf16 layers are unchanged;
- write -> read round trip through the real `do_kv_cache_update` and `forward_qsa`: the write
  hands `reshape_and_cache_flash` the "fp8" dtype and the layer's device scales; the read views
  the same bytes as e4m3 and hands the split-K launcher the layer's host scales. The two CUDA/
  Triton ops are the only stand-ins (`qsa_ref`: the op's quantization, the kernel's indexing
  rules, in torch; the kernel itself is proven against 0.31's on a GPU by
  lab/prove_qsa_fp8_kv_gpu.py). The fp8 output equals the bf16 layer's within the bound the
  e4m3 rounding of the cache implies, and the cache holds e4m3(x / scale) within half an ulp;
- the rewritten kernel/launcher (0.29/0.30) are real Triton JIT functions compiled from anchored
  source, and bf16 calls still go to the stock launcher.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flash_common import releases

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qsa_ref  # noqa: E402

QSA = "vllm.models.qwen4_exp.nvidia.qsa"
OPS = "vllm.models.qwen4_exp.nvidia.ops.qsa"
PORTED = releases.where("qsa_fp8_kv", "patch")
HQ, HKV, D, PAGE, BLOCKS, SEQ, ROWS = 4, 2, 64, 16, 24, 96, 6


def _ctx(base):
    from flash_vllm import compat
    from flash_vllm.registry import Context

    return Context(compat.resolve(compat.installed_vllm_version(), {}), {})


@pytest.fixture(scope="module")
def qsa(registered):
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")
    return importlib.import_module(QSA)


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    from gloo_world import single_process_world

    with single_process_world(tmp_path_factory.mktemp("dist-p7") / "init"):
        yield


def _text_config(qsa):
    # the class qsa.py itself takes (vLLM's own config up to 0.31, transformers' from 0.32)
    return qsa.Qwen4ExpTextConfig(hidden_size=256, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D,
                              indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=2048,
                              indexer_compress_ratio=4, max_position_embeddings=4096,
                              layer_types=["full_attention"], num_hidden_layers=1)


@pytest.fixture(scope="module")
def build(qsa, dist, monkeypatch_module):
    """Build a QSA owner layer on CPU for a cache dtype (fresh VllmConfig each time)."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config

    # The impl asks whether flash-attn's varlen kernel is importable (a CUDA build); QSA itself
    # never calls it. The one stand-in on the build path.
    monkeypatch_module.setattr(qsa, "is_flash_attn_varlen_func_available", lambda: True)
    n = iter(range(1000))

    def make(cache_dtype, init=None):
        cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), cache_config=CacheConfig(cache_dtype=cache_dtype))
        cfg.model_config = SimpleNamespace(dtype=torch.bfloat16, multimodal_config=None, uses_mrope=False)
        kw = dict(vllm_config=cfg, config=_text_config(qsa), layer_id=0, prefix=f"model.layers.{next(n)}.self_attn")
        with set_current_vllm_config(cfg):
            if init is None:
                return qsa.Qwen4ExpQSAAttention(**kw), cfg
            layer = qsa.Qwen4ExpQSAAttention.__new__(qsa.Qwen4ExpQSAAttention)
            init(layer, **kw)
            return layer, cfg

    return make


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_patch_status_apply_idempotent(registered, base, qsa):
    from flash_vllm.registry import by_number

    p = by_number(7)
    if base not in PORTED:
        assert p.expected_status(base) == "upstream"
        p.upstream_check(_ctx(base))
        assert {"fp8", "fp8_e4m3"} <= set(qsa.Qwen4ExpQSAFlashAttentionBackend.supported_kv_cache_dtypes)
        return
    assert 7 in registered["applied"], registered
    ops = importlib.import_module(OPS)
    names = ("Qwen4ExpQSAFlashAttentionImpl.__init__", "Qwen4ExpQSAFlashAttentionImpl.forward_qsa",
             "Qwen4ExpQSAAttention.__init__")
    before = [getattr(qsa, n.split(".")[0]).__dict__[n.split(".")[1]] for n in names]
    launcher = ops.qsa_sparse_paged_attention
    dtypes = list(qsa.Qwen4ExpQSAFlashAttentionBackend.supported_kv_cache_dtypes)
    ctx = _ctx(base)
    p.check(ctx)          # still passes once applied
    p.apply(ctx)
    p.verify(ctx)
    after = [getattr(qsa, n.split(".")[0]).__dict__[n.split(".")[1]] for n in names]
    assert after == before and ops.qsa_sparse_paged_attention is launcher
    assert qsa.Qwen4ExpQSAFlashAttentionBackend.supported_kv_cache_dtypes == dtypes
    assert dtypes.count("fp8") == dtypes.count("fp8_e4m3") == 1
    assert all(f.__flash_patch__ == 7 for f in after)


def test_backend_accepts_fp8(qsa):
    be = qsa.Qwen4ExpQSAFlashAttentionBackend
    for dt in ("fp8", "fp8_e4m3", "auto", "bfloat16", None):
        assert be.supports_kv_cache_dtype(dt), dt
    assert not be.supports_kv_cache_dtype("fp8_e5m2")


def test_stock_refuses_fp8(base, build, qsa):
    init = qsa.Qwen4ExpQSAAttention.__init__
    if base not in PORTED:
        assert not hasattr(init, "__flash_patch__")   # native code builds fp8 (tests below)
        return
    with pytest.raises(NotImplementedError, match="BF16 main KV cache"):
        build("fp8", init=init.__flash_original__)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_layer_and_cache_spec(build, cache_dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    layer, cfg = build(cache_dtype)
    assert layer.kv_cache_dtype == cache_dtype and layer.impl.kv_cache_dtype == cache_dtype
    spec = layer.get_kv_cache_spec(cfg)
    assert type(spec) is FullAttentionSpec
    assert spec.dtype == torch.uint8 and spec.kv_quant_mode == get_kv_quant_mode(cache_dtype)
    assert (spec.num_kv_heads, spec.head_size) == (HKV, D)
    bf16, _ = build("auto")
    ref = bf16.get_kv_cache_spec(cfg)
    assert ref.dtype == torch.bfloat16 and ref.page_size_bytes == 2 * spec.page_size_bytes


def _emulate_cache_write(calls):
    """reshape_and_cache_flash's contract, in torch: slot -> (block, offset); fp8 dtypes store
    e4m3(x / scale) (saturated) in the uint8 cache; auto/bf16 store x."""
    def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
        calls.append(dict(dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, cache_dtype=key_cache.dtype))
        n = slot_mapping.shape[0]
        page = key_cache.shape[1]
        blk, off = slot_mapping.long() // page, slot_mapping.long() % page
        for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            if kv_cache_dtype.startswith("fp8"):
                cache.view(torch.float8_e4m3fn)[blk, off] = qsa_ref.quantize_e4m3(src[:n], float(scale))
            else:
                cache[blk, off] = src[:n].to(cache.dtype)
    return reshape_and_cache_flash


def _round_trip(layer, case, monkeypatch, scale):
    """Write every context token through do_kv_cache_update, then read through forward_qsa."""
    fa = importlib.import_module("vllm.v1.attention.backends.flash_attn")
    ops = importlib.import_module(OPS)
    writes, reads = [], []
    monkeypatch.setattr(fa, "reshape_and_cache_flash", _emulate_cache_write(writes), raising=False)

    def launcher(q, k_cache, v_cache, idx, block_table, token_to_req, *rest, k_scale=None, v_scale=None,
                 output_gate=None):
        out = rest[-1]
        reads.append(dict(k_dtype=k_cache.dtype, v_dtype=v_cache.dtype, k_scale=k_scale, v_scale=v_scale,
                          idx_width=idx.shape[1]))
        if k_cache.dtype == torch.uint8:      # 0.32+ below sm_89 (and on CPU): the kernel byte-decodes e4m3
            k_cache, v_cache = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
        out.copy_(qsa_ref.sparse_paged_gqa(q, k_cache, v_cache, idx, block_table, token_to_req,
                                           counted=_counted(), k_scale=k_scale or 1.0, v_scale=v_scale or 1.0,
                                           gate=output_gate))
        return out

    from flash_vllm.registry import is_ours

    installed = ops.qsa_sparse_paged_attention
    if is_ours(installed, 7):  # the port (0.29/0.30): its own dispatch is the launcher
        assert hasattr(installed, "flash_stock"), "the port's dispatch must expose its stock side"
        # the port's dispatch stays in place; beneath it the stock side is a stand-in with the stock
        # launcher's exact signature, which refuses what stock refuses (run40: `k_scale` for bf16)
        real = getattr(installed.flash_stock, "flash_real", installed.flash_stock)  # a round trip before
        stock_sig = inspect.signature(real)

        def stock(*args, **kwargs):
            stock_sig.bind(*args, **kwargs)
            return launcher(*args, **kwargs)

        stock.flash_real = real

        monkeypatch.setattr(installed, "flash_stock", stock)
        monkeypatch.setattr(installed, "flash_fp8", launcher)
    else:
        monkeypatch.setattr(ops, "qsa_sparse_paged_attention", launcher)
    layer._k_scale.fill_(scale)
    layer._v_scale.fill_(scale)
    layer._k_scale_float = layer._v_scale_float = scale    # what a loader with KV scales sets
    torch_dtype = layer.kv_cache_torch_dtype
    layer.kv_cache = torch.zeros(BLOCKS, HKV, PAGE, 2 * D, dtype=torch_dtype)
    # every token of each request's context, written once through the real update path
    k_all, v_all = qsa_ref.split_cache(case["kv"], D)                    # [blocks, page, H, D] bf16
    bt = case["block_table"]
    slots, keys, values = [], [], []
    for r in range(bt.shape[0]):
        for t in range(SEQ):
            b = int(bt[r, t // PAGE])
            slots.append(b * PAGE + t % PAGE)
            keys.append(k_all[b, t % PAGE])
            values.append(v_all[b, t % PAGE])
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    key, value = torch.stack(keys), torch.stack(values)
    layer.impl.do_kv_cache_update(layer, key, value, layer.kv_cache, slot_mapping)

    sel = case["idx"] if _counted() else case["idx"][:, :-1].contiguous()
    assert sel.shape[1] == layer.topk_indices_buffer.shape[1]
    layer.topk_indices_buffer[:ROWS] = sel
    meta = SimpleNamespace(num_actual_tokens=ROWS, block_table=bt)
    q = case["q"]
    out = torch.empty_like(q)
    kw = {}
    if _counted():
        kw = dict(use_prefill_config=False, output_gate=case["gate"])
    layer.impl.forward_qsa(layer, q, q[:, :HKV], q[:, :HKV], layer.kv_cache, meta, out,
                           token_to_req=case["token_to_req"], **kw)
    return out, writes, reads, sel


_COUNTED = {}


def _counted() -> bool:
    return _COUNTED["counted"]


@pytest.fixture(autouse=True)
def _set_counted(base):
    _COUNTED["counted"] = releases.cap(base, "qsa_topk_site") == "indexer"  # packed selection + trailing count


@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_write_read_round_trip(build, monkeypatch, scale, base):
    amp = 1.0 if scale == 1.0 else 2.0         # soft attention (the bound below stays tight); no saturation
    fp8, _ = build("fp8")
    bf16, _ = build("auto")
    width = fp8.topk_indices_buffer.shape[1]
    case = qsa_ref.make_case(rows=ROWS, hq=HQ, hkv=HKV, d=D, page=PAGE, blocks=BLOCKS,
                             topk=width - 1 if _counted() else width, seq=SEQ, amp=amp, seed=7)
    out8, w8, r8, sel = _round_trip(fp8, case, monkeypatch, scale)
    out16, w16, r16, _ = _round_trip(bf16, case, monkeypatch, 1.0)

    # the write: the real update path passed the fp8 dtype and the layer's device scales
    assert [w["dtype"] for w in w8] == ["fp8"] and w8[0]["cache_dtype"] == torch.uint8
    assert w8[0]["k_scale"] is fp8._k_scale and w8[0]["v_scale"] is fp8._v_scale
    assert [w["dtype"] for w in w16] == ["auto"]
    # the read: same bytes viewed as e4m3, the host scales handed to the launcher
    # (0.29-0.31 view it as e4m3 here; 0.32+ hand the raw uint8 on devices below sm_89, CPU included)
    e4m3 = torch.float8_e4m3fn if base in releases.span("0.29.0", until="0.32.0") else r8[0]["k_dtype"]
    assert e4m3 in (torch.float8_e4m3fn, torch.uint8)
    assert r8 == [dict(k_dtype=e4m3, v_dtype=e4m3, k_scale=scale, v_scale=scale, idx_width=sel.shape[1])]
    assert r16[0]["k_dtype"] == torch.bfloat16 and r16[0]["k_scale"] is None

    # cache bytes: e4m3(x / scale), within half an e4m3 ulp of x (2^-4 relative; 2^-10 absolute
    # in the subnormal range), and exactly what the bf16 cache holds once dequantized and rounded
    k8, v8 = (t.view(torch.float8_e4m3fn) for t in qsa_ref.split_cache(fp8.kv_cache, D))
    k16, v16 = qsa_ref.split_cache(bf16.kv_cache, D)
    used = torch.zeros(BLOCKS, dtype=torch.bool)
    used[case["block_table"].flatten().long()] = True
    for c8, c16 in ((k8, k16), (v8, v16)):
        x, deq = c16[used].float(), c8[used].float() * scale
        assert torch.all((deq - x).abs() <= 2 ** -4 * x.abs() + 2 ** -10 * scale)
        assert torch.equal(c8[used], qsa_ref.quantize_e4m3(c16[used], scale))
    assert not torch.equal(k8.float() * scale, k16.float()), "the fp8 cache must actually be quantized"

    # the output: fp8 vs bf16 within the bound the cache's e4m3 rounding implies (qsa_ref), plus
    # the bf16 rounding of both outputs
    counted = _counted()
    gather = dict(counted=counted)
    vmax = float(v16[used].float().abs().max())
    bound = qsa_ref.e4m3_output_bound(case["q"], k16, v16, k8, v8, sel, case["block_table"], case["token_to_req"],
                                      scale=scale, **gather)
    assert float(bound.max()) < vmax / 2, "bound too loose to mean anything for these inputs"
    err = (out8.float() - out16.float()).abs().amax(dim=-1)                      # [rows, heads]
    assert float(err.max()) > 0, "fp8 and bf16 outputs identical: the cache was not quantized"
    assert torch.all(err <= bound + 2 ** -7 * vmax), (err, bound)
    # and the fp8 output is exactly the reference over the dequantized cache (the plumbing adds
    # nothing: same selection, same scales)
    ref = qsa_ref.sparse_paged_gqa(case["q"], k8, v8, sel, case["block_table"], case["token_to_req"],
                                   k_scale=scale, v_scale=scale, gate=case["gate"] if counted else None, **gather)
    assert torch.equal(out8, ref.to(torch.bfloat16))


def test_rewritten_kernel_is_compiled_triton(base, qsa):
    if base not in PORTED:
        return
    import triton

    from flash_vllm.patches import p07_qsa_fp8_kv as p7

    ops = importlib.import_module(OPS)
    disp = ops.qsa_sparse_paged_attention
    assert disp.__flash_original__.__name__ == "qsa_sparse_paged_attention"
    built = p7.fp8_ops(ops, base)
    kernel = built["kernel"]
    if isinstance(ops._qsa_sparse_paged_gqa_splitk_kernel, triton.runtime.jit.JITFunction):
        assert isinstance(kernel, triton.runtime.jit.JITFunction)
        assert kernel is not ops._qsa_sparse_paged_gqa_splitk_kernel
    names = list(inspect_params(kernel))
    assert names[names.index("output_ptr") + 1: names.index("output_ptr") + 3] == ["softmax_scale", "output_scale"]
    assert names[-1] == "IS_FP8"
    src = p7.function_source(ops, p7.KERNEL)
    new = p7.rewrite(src, p7.KERNEL_EDITS, "kernel")
    assert "softmax_scale_log2" not in new and new.count("if IS_FP8:") == 2
    assert built["attention"].__globals__[p7.KERNEL] is kernel
    # the installed dispatch sends only e4m3 caches to the rewritten launcher
    pred = [c.cell_contents for c in disp.__closure__ if getattr(c.cell_contents, "__name__", "") == "k_is_fp8"]
    assert len(pred) == 1 and disp.flash_fp8 is not disp.__flash_original__
    q = torch.zeros(1, HQ, D, dtype=torch.bfloat16)
    assert pred[0](q, torch.zeros(1, 1, 1, 1, dtype=torch.float8_e4m3fn)) is True
    assert pred[0](q, torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16)) is False


def inspect_params(kernel):
    import inspect

    fn = getattr(kernel, "fn", kernel)
    return inspect.signature(fn).parameters


def test_anchor_drift_is_refused(base, qsa):
    """A release whose kernel no longer carries an anchor fails check() loudly, naming it."""
    if base not in PORTED:
        return
    from flash_vllm.patches import p07_qsa_fp8_kv as p7
    from flash_vllm.registry import TargetMissing

    src = p7.function_source(importlib.import_module(OPS), p7.KERNEL)
    with pytest.raises(TargetMissing, match="scores = tl.dot"):
        p7.rewrite(src.replace("scores = tl.dot(query, keys)", "scores = tl.dot(query, keys, acc=None)"),
                   p7.KERNEL_EDITS, "kernel")
    with pytest.raises(TargetMissing, match="found 2 times"):
        p7.rewrite(src + src, p7.KERNEL_EDITS, "kernel")
