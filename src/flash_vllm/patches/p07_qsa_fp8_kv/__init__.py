"""Patch 7: fp8 (e4m3) KV cache on QSA layers. Native from 0.31.0; ported here to 0.29 and 0.30.

0.31 (vllm#55557) did it in four places, and this port does the same, no more:

1. Backend `Qwen4ExpQSAFlashAttentionBackend`: `supported_kv_cache_dtypes` gains fp8/fp8_e4m3,
   `supports_kv_cache_dtype` stops probing flash-attn (QSA never runs flash-attn over the cache),
   `supports_combination` accepts what it is handed.
2. Impl `Qwen4ExpQSAFlashAttentionImpl.__init__`: the parent's flash-attn fp8 probe gets "auto",
   the real dtype is restored after it (the write path, `FlashAttentionImpl.do_kv_cache_update`
   -> `reshape_and_cache_flash(..., self.kv_cache_dtype, layer._k_scale, layer._v_scale)`,
   reads it at call time and already quantizes; it is unchanged between 0.30 and 0.31).
3. Layer `Qwen4ExpQSAAttention.__init__` accepts fp8/fp8_e4m3 and uint8 cache storage, so
   `get_kv_cache_spec` returns a `FullAttentionSpec(dtype=torch.uint8, ...)`; `forward_qsa` views
   the uint8 cache as float8_e4m3fn and passes the layer's host scales `_k_scale_float` /
   `_v_scale_float` (0.31 reads these, not the device `_k_scale`; see "scales" below).
4. Read path `ops/qsa.py`: the split-K Triton kernel gets runtime `softmax_scale` (with the K
   scale folded in) and `output_scale` (the V scale) and a constexpr `IS_FP8` that upcasts K to
   Q's dtype before QK and V to fp16 before PV, the exact lines of 0.31's kernel. The Python
   launcher (and on 0.30 the warm-up) learn the fp8 case the same way.

Mechanism: (2) is a wrapper; (1) replaces class attributes; (3) and (4) are anchored rewrites of
the release's own source (every anchor must occur exactly once, else TargetMissing), compiled in
the defining module's namespace. The rewritten kernel is a *separate* JIT function reached only
for fp8 caches: with a bf16 cache every call goes to the stock function and the stock kernel,
bit for bit. The kernel tiles stay the release's table (0.31 uses the same GB300 table on sm_121;
its sm_120 / sm_90 tables are tuning, not correctness).

Scales: like 0.31, the read path uses the host floats `_k_scale_float`/`_v_scale_float` while
the write path uses the device buffers `_k_scale`/`_v_scale`. Nothing on QSA owners copies a
loaded checkpoint k/v scale into the floats (not in 0.31 either), so both are 1.0 unless the
checkpoint ships KV scales; `check_qsa_fp8_kv.py` pins this default.
"""

from __future__ import annotations

import __future__
import ast
import inspect
import itertools
import linecache

from flash_common import releases

from ...registry import (Context, Gate, Patch, TargetMissing, expect_installed, import_target,
                        install, is_ours, resolve)

NUMBER = 7
QSA = "vllm.models.qwen4_exp.nvidia.qsa"
OPS = "vllm.models.qwen4_exp.nvidia.ops.qsa"
MODEL = "vllm.models.qwen4_exp.nvidia.model"
FP8 = ("fp8", "fp8_e4m3")
BACKEND = (QSA, "Qwen4ExpQSAFlashAttentionBackend.supported_kv_cache_dtypes")
KERNEL = "_qsa_sparse_paged_gqa_splitk_kernel"
ATTENTION = "qsa_sparse_paged_attention"
WARMUP = "warmup_qsa_sparse_paged_attention"          # 0.30 only (0.29 has no warm-up)
PORTED = tuple(sorted(releases.where("qsa_fp8_kv", "patch")))

# --- the anchored edits (old, new); each `old` must occur exactly once in its function --------

KERNEL_EDITS = (
    ("\n    output_ptr,\n", "\n    output_ptr,\n    softmax_scale,\n    output_scale,\n"),
    ("    BLOCK_N: tl.constexpr,\n) -> None:",
     "    BLOCK_N: tl.constexpr,\n    IS_FP8: tl.constexpr,\n) -> None:"),
    ("    softmax_scale_log2: tl.constexpr = (HEAD_DIM**-0.5) * 1.4426950408889634\n",
     "    score_scale = softmax_scale * 1.4426950408889634\n"),
    ("        scores = tl.dot(query, keys)\n",
     "        if IS_FP8:\n            keys = keys.to(query.dtype)\n        scores = tl.dot(query, keys)\n"),
    ("        scores *= softmax_scale_log2\n", "        scores *= score_scale\n"),
    ("        accumulator = tl.dot(\n            probabilities.to(values.dtype),\n",
     "        if IS_FP8:\n            values = values.to(tl.float16)\n"
     "        accumulator = tl.dot(\n            probabilities.to(values.dtype),\n"),
    ("        accumulator / tl.maximum(normalizer[:, None], 1.0e-20),\n",
     "        accumulator * (output_scale / tl.maximum(normalizer, 1.0e-20))[:, None],\n"),
)

ATTENTION_EDITS = (
    ("    out: torch.Tensor | None = None,\n",
     "    out: torch.Tensor | None = None,\n    k_scale: float | None = None,\n"
     "    v_scale: float | None = None,\n"),
    ("    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16\n",
     "    assert q.dtype == torch.bfloat16\n"
     "    assert k_cache.dtype == v_cache.dtype\n"
     "    is_fp8 = k_cache.dtype == torch.float8_e4m3fn\n"
     "    if is_fp8:\n"
     "        assert k_scale is not None and v_scale is not None\n"
     "        softmax_scale = (q.shape[2] ** -0.5) * float(k_scale)\n"
     "        output_scale = float(v_scale)\n"
     "    else:\n"
     "        assert k_cache.dtype == torch.bfloat16\n"
     "        softmax_scale = q.shape[2] ** -0.5\n"
     "        output_scale = 1.0\n"),
    ("        token_to_req,\n        partial_output,\n        partial_lse,\n        out,\n",
     "        token_to_req,\n        partial_output,\n        partial_lse,\n        out,\n"
     "        softmax_scale,\n        output_scale,\n"),
    ("        BLOCK_N=block_n,\n", "        BLOCK_N=block_n,\n        IS_FP8=is_fp8,\n"),
)

WARMUP_EDITS = (
    ("    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)\n",
     "    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)\n"
     "    is_fp8 = kv_cache.dtype == torch.uint8\n"
     "    cache_dtype = torch.float8_e4m3fn if is_fp8 else key_cache.dtype\n"),
    ("        key_cache.dtype,\n", "        cache_dtype,\n"),
    ("        value_cache.dtype,\n", "        cache_dtype,\n"),
    ("            output_ptr,\n            output_gate_ptr,\n",
     "            output_ptr,\n            1.0,\n            1.0,\n            output_gate_ptr,\n"),
    ("            BLOCK_N=block_n,\n", "            BLOCK_N=block_n,\n            IS_FP8=is_fp8,\n"),
)

FORWARD_EDITS = (
    ("        if key_cache.dtype != torch.bfloat16 or query.dtype != torch.bfloat16:\n"
     "            raise NotImplementedError(\"Qwen4Exp QSA requires BF16 Q/K/V\")\n",
     "        k_scale = v_scale = None\n"
     "        if self.kv_cache_dtype in (\"fp8\", \"fp8_e4m3\"):\n"
     "            key_cache = key_cache.view(torch.float8_e4m3fn)\n"
     "            value_cache = value_cache.view(torch.float8_e4m3fn)\n"
     "            k_scale = layer._k_scale_float\n"
     "            v_scale = layer._v_scale_float\n"
     "        if query.dtype != torch.bfloat16 or key_cache.dtype not in (\n"
     "            torch.bfloat16,\n"
     "            torch.float8_e4m3fn,\n"
     "        ):\n"
     "            raise NotImplementedError(\n"
     "                \"Qwen4Exp QSA requires BF16 Q and BF16 or FP8-e4m3 K/V\"\n"
     "            )\n"),
    ("            output[:num_tokens],\n",
     "            output[:num_tokens],\n            k_scale=k_scale,\n            v_scale=v_scale,\n"),
)

LAYER_INIT_EDITS = (
    ("        if cache_config.cache_dtype not in (\"auto\", \"bfloat16\"):\n",
     "        if cache_config.cache_dtype not in (\"auto\", \"bfloat16\", \"fp8\", \"fp8_e4m3\"):\n"),
    ("        if self.kv_cache_torch_dtype != torch.bfloat16:\n",
     "        if self.kv_cache_torch_dtype not in (torch.bfloat16, torch.uint8):\n"),
)

IMPL_ANCHOR = 'if self.kv_cache_dtype not in ("auto", "bfloat16"):'


def rewrite(src: str, edits, where: str) -> str:
    for old, new in edits:
        n = src.count(old)
        if n != 1:
            raise TargetMissing(f"{where}: anchor found {n} times, want 1: {old.strip()[:70]!r}")
        src = src.replace(old, new)
    return src


def function_source(module, name: str) -> str:
    """The top-level def `name` of `module`, decorators included, read from the module's file
    (works whatever `triton.jit` returned: a JITFunction or the CPU placeholder's function)."""
    try:
        text = inspect.getsource(module)
    except (OSError, TypeError) as e:
        raise TargetMissing(f"{module.__name__}: source unavailable ({e})") from e
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            return "\n".join(text.splitlines()[first - 1:node.end_lineno]) + "\n"
    raise TargetMissing(f"{module.__name__}: no top-level def {name}")


def method_source(cls, name: str) -> str:
    fn = inspect.getattr_static(cls, name)
    try:
        src = inspect.getsource(fn)     # class-level indentation kept: the anchors carry it
    except (OSError, TypeError) as e:
        raise TargetMissing(f"{cls.__name__}.{name}: source unavailable ({e})") from e
    if "super()" in src or "__class__" in src:
        raise TargetMissing(f"{cls.__name__}.{name} uses super(); cannot be recompiled outside its class")
    return src


_serial = itertools.count()


def compile_into(namespace: dict, src: str, name: str, label: str):
    """exec `src` (defining `name`) in `namespace`; the source is registered in linecache so
    `inspect.getsource` (Triton's JIT reads it) finds the rewritten text."""
    filename = f"<flash_vllm patch 7: {label} #{next(_serial)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    # the release modules use `from __future__ import annotations`; so does the rewritten code
    exec(compile(src, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True),
         namespace)
    return namespace[name]


def fp8_ops(ops, base: str) -> dict:
    """The fp8-capable copies of the release's kernel, launcher (and 0.30 warm-up), compiled in
    a copy of `ops`' namespace where the kernel name is the rewritten kernel."""
    ns = dict(vars(ops))
    out = {"kernel": compile_into(ns, rewrite(function_source(ops, KERNEL), KERNEL_EDITS, KERNEL),
                                  KERNEL, KERNEL)}
    out["attention"] = compile_into(
        ns, rewrite(function_source(ops, ATTENTION), ATTENTION_EDITS, ATTENTION), ATTENTION, ATTENTION)
    if base == "v0.30":
        out["warmup"] = compile_into(
            ns, rewrite(function_source(ops, WARMUP), WARMUP_EDITS, WARMUP), WARMUP, WARMUP)
    return out


# --- the registry hooks ------------------------------------------------------------------------

def _modules():
    import_target(MODEL)          # qsa.py imports back into model.py: load the model first
    return import_target(QSA), import_target(OPS)


def check(ctx: Context) -> None:
    qsa, ops = _modules()
    base = ctx.base.name
    backend = qsa.Qwen4ExpQSAFlashAttentionBackend
    combo = inspect.getattr_static(backend, "supports_combination", None)
    if not is_ours(getattr(combo, "__func__", combo), NUMBER):
        if set(FP8) & set(backend.supported_kv_cache_dtypes):
            raise TargetMissing("QSA backend already lists fp8 (fixed upstream?)")
    impl_init = inspect.getattr_static(qsa.Qwen4ExpQSAFlashAttentionImpl, "__init__")
    src = inspect.getsource(getattr(impl_init, "__flash_original__", impl_init))
    if IMPL_ANCHOR not in src:
        raise TargetMissing(f"Qwen4ExpQSAFlashAttentionImpl.__init__ lacks {IMPL_ANCHOR!r}")
    for cls, name, edits in ((qsa.Qwen4ExpQSAFlashAttentionImpl, "forward_qsa", FORWARD_EDITS),
                             (qsa.Qwen4ExpQSAAttention, "__init__", LAYER_INIT_EDITS)):
        fn = inspect.getattr_static(cls, name)
        if is_ours(fn, NUMBER):
            continue
        rewrite(method_source(cls, name), edits, f"{cls.__name__}.{name}")
    fp8_ops(ops, base)            # every kernel/launcher anchor, and the result compiles


def _method_from_source(cls, name: str, edits, qsa):
    def make(orig):
        src = rewrite(method_source(cls, name), edits, f"{cls.__name__}.{name}")
        holder = compile_into(dict(vars(qsa)), f"class _Holder:\n{src}", "_Holder",
                              f"{cls.__name__}.{name}")
        fn = holder.__dict__[name]
        fn.__qualname__ = f"{cls.__qualname__}.{name}"
        return fn
    return make


def _make_impl_init(orig):
    def __init__(self, *args, **kwargs):
        # The parent probes flash-attn for quantized-KV support; QSA never runs flash-attn over
        # the cache (0.31 does the same: "auto" for the probe, the real dtype restored after).
        args = list(args)
        real = args[6] if len(args) > 6 else kwargs.get("kv_cache_dtype")
        if real in FP8:
            if len(args) > 6:
                args[6] = "auto"
            else:
                kwargs["kv_cache_dtype"] = "auto"
        orig(self, *args, **kwargs)
        if real in FP8:
            self.kv_cache_dtype = real
    return __init__


# keywords only the fp8 copies take: the rewritten forward_qsa always passes them (None for a
# bf16 cache), and the stock launcher refuses them (run40: every 0.29 boot died on `k_scale`)
FP8_ONLY_KWARGS = ("k_scale", "v_scale")


def _dispatch(orig, fp8_fn, is_fp8):
    """The fp8 copy for fp8 caches, else the stock function without the fp8-only keywords. Both
    are read from the wrapper at call time (`flash_fp8`, `flash_stock`), so a check can put a
    stand-in with the stock signature underneath."""
    def fn(*args, **kwargs):
        if is_fp8(*args, **kwargs):
            return fn.flash_fp8(*args, **kwargs)
        for k in FP8_ONLY_KWARGS:
            if kwargs.get(k) is not None:
                raise ValueError(f"{fn.__name__}: {k}={kwargs[k]!r} given for a non-fp8 cache")
            kwargs.pop(k, None)
        return fn.flash_stock(*args, **kwargs)
    fn.__name__ = orig.__name__
    fn.__doc__ = orig.__doc__
    fn.flash_fp8 = fp8_fn
    fn.flash_stock = orig
    return fn


def apply(ctx: Context) -> None:
    import torch

    qsa, ops = _modules()
    backend = qsa.Qwen4ExpQSAFlashAttentionBackend
    dtypes = list(backend.supported_kv_cache_dtypes)
    backend.supported_kv_cache_dtypes = dtypes + [d for d in FP8 if d not in dtypes]
    install(NUMBER, QSA, "Qwen4ExpQSAFlashAttentionBackend.supports_kv_cache_dtype",
            lambda orig: lambda cls, kv_cache_dtype: (kv_cache_dtype is None
                                                       or kv_cache_dtype in cls.supported_kv_cache_dtypes))
    install(NUMBER, QSA, "Qwen4ExpQSAFlashAttentionBackend.supports_combination",
            lambda orig: lambda cls, *args, **kwargs: None)
    install(NUMBER, QSA, "Qwen4ExpQSAFlashAttentionImpl.__init__", _make_impl_init)
    install(NUMBER, QSA, "Qwen4ExpQSAFlashAttentionImpl.forward_qsa",
            _method_from_source(qsa.Qwen4ExpQSAFlashAttentionImpl, "forward_qsa", FORWARD_EDITS, qsa))
    install(NUMBER, QSA, "Qwen4ExpQSAAttention.__init__",
            _method_from_source(qsa.Qwen4ExpQSAAttention, "__init__", LAYER_INIT_EDITS, qsa))

    if is_ours(getattr(ops, ATTENTION), NUMBER):
        return
    built = fp8_ops(ops, ctx.base.name)

    def k_is_fp8(q, k_cache, *a, **k):
        return k_cache.dtype == torch.float8_e4m3fn

    install(NUMBER, OPS, ATTENTION, lambda orig: _dispatch(orig, built["attention"], k_is_fp8))
    if "warmup" in built:
        def cache_is_fp8(kv_cache, *a, **k):
            return kv_cache.dtype == torch.uint8
        install(NUMBER, OPS, WARMUP, lambda orig: _dispatch(orig, built["warmup"], cache_is_fp8))


def verify(ctx: Context) -> None:
    qsa, _ = _modules()
    for name in ("Qwen4ExpQSAFlashAttentionBackend.supports_kv_cache_dtype",
                 "Qwen4ExpQSAFlashAttentionBackend.supports_combination",
                 "Qwen4ExpQSAFlashAttentionImpl.__init__", "Qwen4ExpQSAFlashAttentionImpl.forward_qsa",
                 "Qwen4ExpQSAAttention.__init__"):
        expect_installed(NUMBER, QSA, name)
    expect_installed(NUMBER, OPS, ATTENTION)
    if ctx.base.name == "v0.30":
        expect_installed(NUMBER, OPS, WARMUP)
    if not set(FP8) <= set(qsa.Qwen4ExpQSAFlashAttentionBackend.supported_kv_cache_dtypes):
        raise TargetMissing("QSA backend does not list fp8 after apply")


def upstream_check(ctx: Context) -> None:
    import_target(MODEL)
    _, _, dtypes = resolve(*BACKEND)
    if not set(FP8) <= set(dtypes):
        raise TargetMissing(f"QSA backend supports {list(dtypes)}, no fp8")


PATCH = Patch(
    number=NUMBER,
    name="qsa-fp8-kv",
    title="fp8 (e4m3) KV cache on QSA layers",
    why=("Halves the main KV cache of the 12 QSA layers. Native since 0.31.0; on 0.29/0.30 a port "
         "of 0.31's change: fp8 cache spec, the stock fp8 write (reshape_and_cache_flash with the "
         "layer's scales), and an anchored copy of the split-K Triton kernel that dequantizes "
         "e4m3 K/V, reached only for fp8 caches (bf16 keeps the stock kernel)."),
    upstream="vllm#54426 (RFC) -> vllm#55557 (in 0.31.0)",
    gate=Gate(None, "--kv-cache-dtype fp8|fp8_e4m3 (bf16 caches take the stock path)"),
    targets=(":".join(BACKEND), f"{QSA}:Qwen4ExpQSAFlashAttentionImpl.__init__",
             f"{QSA}:Qwen4ExpQSAFlashAttentionImpl.forward_qsa", f"{QSA}:Qwen4ExpQSAAttention.__init__",
             f"{OPS}:{ATTENTION}", f"{OPS}:{KERNEL}", f"{OPS}:{WARMUP} (0.30)"),
    applies_to=frozenset(PORTED),
    upstream_in=releases.where("qsa_fp8_kv", "native"),
    not_ported={b: "no port of patch 7 to this release (catalogue: qsa_fp8_kv=None)"
                for b in releases.where("qsa_fp8_kv", None)},
    check=check,
    apply=apply,
    verify=verify,
    upstream_check=upstream_check,
)
