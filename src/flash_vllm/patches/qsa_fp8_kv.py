"""Patch 7: fp8 KV cache on QSA layers. Native from 0.31.0; not ported to 0.29/0.30.

0.29 and 0.30 refuse an fp8 main KV cache for QSA in three places and read the cache as bf16
inside the split-K Triton kernel; supporting it means dequantizing inside that kernel (scale
pointers, a constexpr quant mode, halved tiles for the 99 KiB shared memory). Those are kernel
rewrites that cannot run or be tested on a CPU, and 0.31 ships the same feature natively
(vllm#55557), so we do not carry them. On v0.29/v0.30 the run spec must refuse KV_DTYPE=fp8*
(vLLM itself raises "Qwen4Exp QSA requires a BF16 main KV cache" at model init).
"""

from ..registry import Context, Gate, Patch, TargetMissing, import_target, resolve

BACKEND = ("vllm.models.qwen4_exp.nvidia.qsa", "Qwen4ExpQSAFlashAttentionBackend.supported_kv_cache_dtypes")


def upstream_check(ctx: Context) -> None:
    # qsa.py is only importable after the model module (it imports back into it).
    import_target("vllm.models.qwen4_exp.nvidia.model")
    _, _, dtypes = resolve(*BACKEND)
    if not {"fp8", "fp8_e4m3"} <= set(dtypes):
        raise TargetMissing(f"QSA backend supports {list(dtypes)}, no fp8")


PATCH = Patch(
    number=7,
    name="qsa-fp8-kv",
    title="fp8 (e4m3) KV cache on QSA layers",
    why=("Halves the main KV cache of the 12 QSA layers. Native since 0.31.0 (the QSA Triton "
         "kernel dequantizes the e4m3 cache itself)."),
    upstream="vllm#54426 (RFC) -> vllm#55557 (in 0.31.0)",
    gate=Gate(None, "--kv-cache-dtype fp8|fp8_e4m3 (native where supported)"),
    targets=(":".join(BACKEND),),
    upstream_in=frozenset({"v0.31", "v0.32", "v0.33"}),
    not_ported={"v0.29": "kernel rewrite, untestable on CPU; run spec refuses fp8 KV",
                "v0.30": "kernel rewrite, untestable on CPU; run spec refuses fp8 KV"},
    upstream_check=upstream_check,
)
