"""lab/bench_side_gemm.py against each release's source (CPU): the shapes it times are the ones
vLLM's Qwen4Exp itself tunes for a GB10 at TP=1 (0.32+), the FP8 path it builds is the one
ModelOpt's FP8_PB_WO resolves to, and every kernel it forces is one the release lists for CUDA."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def sg():
    from lab import bench_side_gemm  # the repository root is on sys.path (`python -m pytest` from it)

    return bench_side_gemm


def plan_tables() -> dict[str, set[tuple[int, int]]]:
    """Each `QWEN4_EXP_*GEMM_PLANS` dict in the release's low_latency_gemm.py: its (N, K) keys."""
    spec = importlib.util.find_spec("vllm")
    src = Path(next(iter(spec.submodule_search_locations))) / "models/qwen4_exp/nvidia/low_latency_gemm.py"
    tables = {}
    for node in ast.parse(src.read_text()).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Dict):
            if node.target.id.endswith("GEMM_PLANS"):
                tables[node.target.id] = {ast.literal_eval(k) for k in node.value.keys}
    return tables


def test_side_shapes_are_the_gb10_plan_shapes(sg):
    import vllm

    tables = plan_tables()
    assert tables, "no QWEN4_EXP_*GEMM_PLANS table: the model's low-latency GEMM moved"
    shapes = {(s.n, s.k) for s in sg.side_shapes()}
    major_minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    if major_minor >= (0, 32):
        # the release tunes stock's BF16 side layers on sm_121 at exactly these shapes; the H200
        # (sm_90) table holds TP=4 shapes only, so on the device machine stock's are F.linear
        assert shapes <= tables["QWEN4_EXP_SM121_GEMM_PLANS"], shapes - tables["QWEN4_EXP_SM121_GEMM_PLANS"]
        assert not shapes & tables["QWEN4_EXP_SM90_GEMM_PLANS"]
    else:
        assert "QWEN4_EXP_SM121_GEMM_PLANS" not in tables


def test_fp8_pb_wo_resolves_to_the_keys_the_bench_uses():
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8Dynamic128Sym, kFp8Static128BlockSym

    resolve = getattr(modelopt, "resolve", None)
    if resolve is None:  # 0.29-0.31: one linear method class per algorithm
        assert hasattr(modelopt, "ModelOptFp8PbWoLinearMethod")
        return
    spec = resolve("FP8_PB_WO", {}, "model.layers.0.linear_attn.in_proj_qkvz")[0]
    assert (spec.weight, spec.activation) == (kFp8Static128BlockSym, kFp8Dynamic128Sym)


def test_forced_kernels_are_the_releases_cuda_block_kernels(sg):
    import inspect

    from vllm.model_executor.kernels import linear

    assert "force_kernel" in inspect.signature(linear.init_fp8_linear_kernel).parameters
    cuda = {k.__name__ for k in linear._POSSIBLE_FP8_BLOCK_KERNELS[next(p for p in linear._POSSIBLE_FP8_BLOCK_KERNELS
                                                                      if p.name == "CUDA")]}
    assert set(sg.FORCED.values()) <= cuda, set(sg.FORCED.values()) - cuda
