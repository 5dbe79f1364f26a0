"""Patch 8's radix top-k kernel (src/flash_vllm/patches/p08_qsa_det_topk/radix.py) on CPU, through Triton's
interpreter: the same kernel source the GPU compiles, run op by op in numpy.

TRITON_INTERPRET is read when `@triton.jit` wraps a function and cannot be switched afterwards in
a process, so the kernel runs in a child process with TRITON_INTERPRET=1 (`kernel_results`, one
child for the module); the references are computed here. Reference: per row, the columns below
min(visible, columns) sorted by (score descending, column ascending), the first min(k, visible) of
them, in ascending column order, then -1. The cases are the ones a radix select gets wrong first:
ties at the k-th value, all-equal rows, only negative scores, -inf, -0.0 vs +0.0, visible 0,
visible below k, visible past the row, rows longer than one loop step, a wider output than k,
scores spanning every exponent."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # the unit tier's venv has CPU torch (the test extra)

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "random": lambda g: (torch.randn(3, 700, generator=g), [700, 50, 300], 64),
    "ties_at_kth": lambda g: (torch.randint(-3, 3, (3, 700), generator=g).float(), [700, 64, 699], 64),
    "negative_scores": lambda g: (-torch.rand(3, 900, generator=g) * 50 - 1, [900, 500, 64], 100),
    "all_equal": lambda g: (torch.full((2, 300), 0.25), [300, 17], 32),
    "minus_inf": lambda g: (torch.where(torch.rand(2, 400, generator=g) < 0.9, float("-inf"), 1.0), [400, 400], 64),
    "signed_zeros": lambda g: (torch.tensor([[-0.0, 0.0] * 100, [0.0, -0.0] * 100]), [200, 200], 101),
    "visible_zero_and_past_row": lambda g: (torch.randn(3, 300, generator=g), [0, 5000, -3], 16),
    "longer_than_a_loop_step": lambda g: (torch.randn(2, 2600, generator=g) * 1e3, [2600, 2051], 512),
    "k_wider_than_row": lambda g: (torch.randn(2, 40, generator=g), [40, 39], 64),
    "every_exponent": lambda g: (torch.randn(2, 500, generator=g) * torch.exp2(torch.randint(-120, 120, (2, 500),
                                                                                             generator=g).float()),
                                 [500, 480], 100),
    # a wider output than k, and int64 visible counts
    "wider_output": lambda g: (torch.randn(2, 900, generator=g), [900, 10], 64),
    # the hook's own argument shapes: 2048 tokens / ratio 4 = 512 blocks
    "hook": lambda g: (torch.randn(3, 1200, generator=g), [1200, 700, 3], 512),
}
WIDTH = {"wider_output": 80}
VISIBLE_DTYPE = {"wider_output": torch.int64}


def case_inputs(case: str):
    g = torch.Generator().manual_seed(sorted(CASES).index(case))
    logits, visible, k = CASES[case](g)
    return logits, torch.tensor(visible, dtype=VISIBLE_DTYPE.get(case, torch.int32)), k, WIDTH.get(case, k)


def kernel_results() -> dict:
    """Runs in the child (TRITON_INTERPRET=1): every case through the kernel, plus the batch
    independence, the refusals and patch 8's hook in radix mode."""
    from flash_vllm.patches.p08_qsa_det_topk import radix
    from flash_vllm.patches.p05_qsa_exact_topk import hook as _qsa_topk
    from flash_vllm.patches import p08_qsa_det_topk as qsa_det_topk

    assert type(radix._radix_block_topk).__name__ == "InterpretedFunction", type(radix._radix_block_topk)
    res: dict = {"cases": {}}
    for case in CASES:
        logits, vis, k, width = case_inputs(case)
        out = torch.full((logits.shape[0], width), 12345, dtype=torch.int32)
        if case == "hook":
            called = []
            hook = _qsa_topk.make_hook(lambda *a: called.append(a), "radix", "v0.30")
            hook(logits, vis, 2048, 4, out, torch.empty(0))
            res["hook_called_stock"] = bool(called)
        else:
            radix.radix_block_topk(logits, vis, out, k, logits.shape[1])
        res["cases"][case] = out.tolist()
    # a row's selection does not depend on the rows batched with it
    rows = torch.randint(-2, 2, (4, 800), generator=torch.Generator().manual_seed(3)).float()
    vis = torch.tensor([800, 600, 400, 200], dtype=torch.int32)
    whole = torch.zeros(4, 128, dtype=torch.int32)
    radix.radix_block_topk(rows, vis, whole, 128, 800)
    alone = []
    for r in range(4):
        one = torch.zeros(1, 128, dtype=torch.int32)
        radix.radix_block_topk(rows[r:r + 1].contiguous(), vis[r:r + 1], one, 128, 800)
        alone.append(one[0].tolist())
    res["batch_equal"] = [whole[r].tolist() == alone[r] for r in range(4)]
    refusals = []
    for logits, vis, out in ((torch.randn(1, 20, dtype=torch.float64), torch.tensor([10]), torch.zeros(1, 4, dtype=torch.int32)),
                             (torch.randn(20, 2).t(), torch.tensor([10, 10]), torch.zeros(2, 4, dtype=torch.int32)),
                             (torch.randn(1, 20), torch.tensor([10]), torch.zeros(1, 4, dtype=torch.int64))):
        try:
            radix.radix_block_topk(logits, vis, out, 4, 20)
            refusals.append(None)
        except ValueError as exc:
            refusals.append(str(exc))
    res["refusals"] = refusals
    env = {"VLLM_QSA_DET_TOPK": "radix"}
    res["gate"] = [qsa_det_topk.PATCH.enabled(env), _qsa_topk.mode(env),
                   _qsa_topk.mode({**env, "VLLM_QSA_EXACT_TOPK": "1"})]
    return res


def run_interpreted(module: str) -> dict:
    """`module.kernel_results()` (a test module beside this one) in a child with TRITON_INTERPRET=1."""
    code = (f"import json, sys; sys.path[:0] = [{str(ROOT / 'src')!r}, {str(Path(__file__).parent)!r}]\n"
            f"import {module} as t; print(json.dumps(t.kernel_results()))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def child():
    return run_interpreted("test_qsa_radix")


def _bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def reference(logits, visible, k: int, width: int) -> list[list[int]]:
    out = []
    for r in range(logits.shape[0]):
        v = max(0, min(int(visible[r]), logits.shape[1]))
        kk = max(0, min(k, v))
        row = logits[r, :v].tolist()
        # compared by bit order like the kernel: -0.0 below +0.0 (other equal floats tie)
        ranked = sorted(range(v), key=lambda j: (-row[j], -_bits(row[j]) if row[j] == 0 else 0, j))
        out.append(sorted(ranked[:kk]) + [-1] * (width - kk))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_radix_topk_matches_the_reference(child, case):
    logits, vis, k, width = case_inputs(case)
    assert child["cases"][case] == reference(logits, vis, k, width)


def test_the_same_scores_give_the_same_answer_in_any_batch(child):
    assert child["batch_equal"] == [True] * 4


def test_refuses_what_it_cannot_read(child):
    wrong_dtype, wrong_stride, wrong_out = child["refusals"]
    assert "fp32 scores" in wrong_dtype and "unit column stride" in wrong_stride and "int32 block indices" in wrong_out


def test_the_hook_routes_radix_mode_to_the_kernel_not_the_stock_op(child):
    """`VLLM_QSA_DET_TOPK=radix`: patch 8's gate is on, the hook's mode is `radix` (EXACT_TOPK still
    wins), and the 0.30+ replacement of `_topk` answered the "hook" case without the stock op."""
    assert child["gate"] == [True, "radix", "exact"]
    assert child["hook_called_stock"] is False


TTIR = """
import sys; sys.path.insert(0, {src!r})
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.compiler.compiler import ASTSource
from flash_vllm.patches.p08_qsa_det_topk import radix as q
target = GPUTarget("cuda", 90, 32)  # the H200; the front end needs no GPU
backend = make_backend(target)
options = backend.parse_options({{}})
sig = {{"logits_ptr": "*fp32", "stride_row": "i64", "visible_ptr": "*i32", "out_ptr": "*i32", "stride_out": "i64",
        "columns": "i32", "k": "i32", "width": "i32", "BLOCK": "constexpr"}}
ctx = ir.context(); ir.load_dialects(ctx); backend.load_dialects(ctx)
mod = ASTSource(q._radix_block_topk, sig, constexprs={{"BLOCK": q.BLOCK}}).make_ir(
    target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
print("ttir", "tt.histogram" in str(mod))
"""


def test_the_kernel_passes_the_real_compilers_front_end():
    """The interpreter runs Python, so it accepts what the compiler refuses: run38 on the H200 died
    in `ast_to_ttir` ("shift is already defined. constexpr cannot be reassigned") while every
    interpreter test passed. Triton's own front end lowers the kernel to TTIR here without a GPU
    (no TRITON_INTERPRET in this child)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", TTIR.format(src=str(ROOT / "src"))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ttir True", proc.stdout
