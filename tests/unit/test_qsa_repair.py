"""Patch 8's repair kernel (`_qsa_radix.repair_block_topk`, VLLM_QSA_DET_TOPK=repair) on CPU, through
Triton's interpreter, in a child process like tests/unit/test_qsa_radix.py (whose CASES and
reference it reuses).

The kernel runs after the stock top-k and rewrites its output in place. The stand-in for the stock
output here is an exact top-k whose ties at the k-th value are resolved at random and whose slots
are shuffled (what a nondeterministic exact kernel may return); three such draws per case must all
be repaired into the reference: the same set and order whatever the stock kernel chose. A stock
output that is not an exact top-k (a missing element, the best swapped for the (k+1)-th, garbage
indices: what vllm#51782's dropped candidates look like) fails the kernel's certificate, and the
kernel finds the k-th key itself: the reference again."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # the unit tier's venv has CPU torch (the test extra)

from test_qsa_radix import CASES, _bits, case_inputs, reference, run_interpreted

ROOT = Path(__file__).resolve().parents[2]
DRAWS = 3  # scrambled stock outputs per case
UNSET = 12345  # slots the stock kernel never writes (past k) keep whatever was there
# the repair's variants: one program per row (run43's), and two launches over column slices of a
# width that splits every case's rows into several (and one not a power of two, shorter than a loop step)
VARIANTS = {"serial": None, "slices_256": 256, "slices_96": 96}
NO_TIES = ("random", "negative_scores", "visible_zero_and_past_row", "longer_than_a_loop_step",
           "k_wider_than_row", "every_exponent", "wider_output", "hook")  # continuous random scores


def _rank(row: list[float], j: int, tiebreak: float) -> tuple:
    # the reference's order (score descending, -0.0 below +0.0), ties by `tiebreak`
    return (-row[j], -_bits(row[j]) if row[j] == 0 else 0, tiebreak)


def scrambled_stock(logits, visible, k: int, width: int, seed: int) -> list[list[int]]:
    """An exact top-k per row (by the kernel's total order) with ties at the k-th value picked at
    random and the slots shuffled; -1 in slots [kk, k), UNSET past k (the stock op writes k slots)."""
    rng = random.Random(seed)
    out = []
    for r in range(logits.shape[0]):
        v = max(0, min(int(visible[r]), logits.shape[1]))
        kk = max(0, min(k, v))
        row = logits[r, :v].tolist()
        noise = [rng.random() for _ in range(v)]
        chosen = sorted(range(v), key=lambda j: _rank(row, j, noise[j]))[:kk]
        rng.shuffle(chosen)
        out.append((chosen + [-1] * (k - kk) + [UNSET] * width)[:width])
    return out


def broken_stock(logits, visible, k: int, width: int) -> dict[str, list[list[int]]]:
    """Stock outputs that are not an exact top-k (rows of the reference, damaged)."""
    ref = reference(logits, visible, k, width)
    out = {"missing": [], "best_swapped": [], "garbage": []}
    for r, sel in enumerate(ref):
        v = max(0, min(int(visible[r]), logits.shape[1]))
        kk = max(0, min(k, v))
        row = logits[r, :v].tolist()
        ranked = sorted(range(v), key=lambda j: _rank(row, j, j))
        top = list(reversed(sel[:kk]))
        missing = list(top)
        if missing:
            missing[len(missing) // 2] = -1
        swapped = list(top)
        if swapped and kk < v:
            swapped[swapped.index(ranked[0])] = ranked[kk]
        garbage = [ranked[0] if v else -1, ranked[0] if v else -1, v, logits.shape[1] + 7, -5, 2 ** 31 - 1]
        for name, slots in (("missing", missing), ("best_swapped", swapped), ("garbage", garbage)):
            slots = (slots + [-1] * k)[:k]
            out[name].append((slots + [UNSET] * width)[:width])
    return out


def kernel_results() -> dict:
    """Runs in the child (TRITON_INTERPRET=1): the repair of every case's scrambled and broken stock
    outputs, k = 0, and patch 8's hook in repair mode (stock op first, then the kernel)."""
    from flash_vllm.patches.p08_qsa_det_topk import radix as q
    from flash_vllm.patches.p05_qsa_exact_topk import hook as _qsa_topk
    from flash_vllm.patches import p08_qsa_det_topk as qsa_det_topk

    for kernel in (q._repair_serial, q._repair_count, q._repair_write):
        assert type(kernel).__name__ == "InterpretedFunction", type(kernel)
    res: dict = {"scrambled": {}, "broken": {}, "variants": {}}
    for case in CASES:
        logits, vis, k, width = case_inputs(case)
        runs = []
        for seed in range(DRAWS):
            out = torch.tensor(scrambled_stock(logits, vis, k, width, seed), dtype=torch.int32)
            q.repair_block_topk(logits, vis, out, k, logits.shape[1])
            runs.append(out.tolist())
        res["scrambled"][case] = runs
        res["broken"][case] = {}
        stocks = {f"scrambled{seed}": scrambled_stock(logits, vis, k, width, seed) for seed in range(DRAWS)}
        for name, stock in broken_stock(logits, vis, k, width).items():
            out = torch.tensor(stock, dtype=torch.int32)
            q.repair_block_topk(logits, vis, out, k, logits.shape[1])
            res["broken"][case][name] = out.tolist()
            stocks[name] = stock
        # every stock output (exact or broken) through each variant of the kernel
        res["variants"][case] = {}
        for variant, slice_columns in VARIANTS.items():
            outs = {}
            for name, stock in stocks.items():
                out = torch.tensor(stock, dtype=torch.int32)
                q.repair_block_topk(logits, vis, out, k, logits.shape[1], slice_columns=slice_columns)
                outs[name] = out.tolist()
            res["variants"][case][variant] = outs
    out = torch.tensor([[3, 1, UNSET, UNSET]], dtype=torch.int32)
    q.repair_block_topk(torch.randn(1, 10), torch.tensor([10]), out, 0, 10)
    res["k_zero"] = out.tolist()
    # the hook: the stock op (a scrambled exact top-k) runs, then the repair, on the same buffer
    logits, vis, _, _ = case_inputs("ties_at_kth")
    called = []

    def stock(lg, v, token_topk, ratio, block_indices, ws):
        called.append(token_topk // ratio)
        block_indices.copy_(torch.tensor(scrambled_stock(lg, v, token_topk // ratio, block_indices.shape[1], 7)))

    out = torch.full((logits.shape[0], 64), UNSET, dtype=torch.int32)
    _qsa_topk.make_hook(stock, "repair", "v0.30")(logits, vis, 256, 4, out, torch.empty(0))
    res["hook"] = {"called": called, "out": out.tolist()}
    env = {"VLLM_QSA_DET_TOPK": "repair"}
    res["gate"] = [qsa_det_topk.PATCH.enabled(env), _qsa_topk.mode(env),
                   _qsa_topk.mode({**env, "VLLM_QSA_EXACT_TOPK": "1"})]
    try:
        q.repair_block_topk(torch.randn(1, 20), torch.tensor([10]), torch.zeros(1, 4, dtype=torch.int64), 4, 20)
        res["refusal"] = None
    except ValueError as exc:
        res["refusal"] = str(exc)
    try:
        q.repair_block_topk(torch.randn(1, 20), torch.tensor([10]), torch.zeros(1, 4, dtype=torch.int32), 4, 20,
                            slice_columns=0)
        res["bad_slice"] = None
    except ValueError as exc:
        res["bad_slice"] = str(exc)
    return res


@pytest.fixture(scope="module")
def child():
    return run_interpreted("test_qsa_repair")


@pytest.mark.parametrize("case", sorted(CASES))
def test_any_exact_stock_selection_is_repaired_into_the_reference(child, case):
    logits, vis, k, width = case_inputs(case)
    want = reference(logits, vis, k, width)
    assert child["scrambled"][case] == [want] * DRAWS


def test_the_scrambled_stock_outputs_do_differ_from_the_reference():
    """The inputs exercise the repair: on tie-heavy cases the stock stand-in's sets differ from the
    reference's and from one draw to the next (not only its slot order)."""
    for case in ("ties_at_kth", "all_equal", "signed_zeros", "minus_inf"):
        logits, vis, k, width = case_inputs(case)
        want = [sorted(c for c in row if c >= 0) for row in reference(logits, vis, k, width)]
        sets = [[sorted(c for c in row if 0 <= c < UNSET) for row in scrambled_stock(logits, vis, k, width, s)]
                for s in range(DRAWS)]
        assert all(s != want for s in sets) and sets[0] != sets[1], case


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stock_output_that_is_not_a_top_k_is_repaired_into_the_reference_too(child, case):
    """The certificate (fewer than min(k, visible) keys of the row above the stock threshold, and
    enough reaching it) either still holds (the threshold is the k-th key all the same: the counts
    come from the row, not from the damaged selection) or fails, and the radix select finds the
    k-th key. Before the certificate (ffd7989) these rows were only well-formed: a dropped column
    stayed dropped."""
    logits, vis, k, width = case_inputs(case)
    want = reference(logits, vis, k, width)
    for name, rows in child["broken"][case].items():
        assert rows == want, (case, name)


def test_the_damaged_stock_outputs_are_not_the_reference():
    """The broken inputs exercise the repair: each kind of damage changes the selection's set on the
    plain random case and on most others (not on rows where every visible column is selected and
    nothing can be swapped in)."""
    differs = {}
    for case in CASES:
        logits, vis, k, width = case_inputs(case)
        want = [sorted(c for c in row if c >= 0) for row in reference(logits, vis, k, width)]
        for name, rows in broken_stock(logits, vis, k, width).items():
            got = [sorted(c for c in row if 0 <= c < UNSET) for row in rows]
            if got != want:
                differs.setdefault(name, []).append(case)
    assert all("random" in cases and len(cases) >= len(CASES) // 2 for cases in differs.values()), differs
    assert set(differs) == {"missing", "best_swapped", "garbage"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_sliced_passes_write_what_the_serial_pass_writes(child, case):
    """Cut into slices (two launches over rows x slices), the repair writes element for element what
    the one-program-per-row pass writes, for exact and broken stock outputs alike; the default
    slicing (the first results above) too."""
    got = child["variants"][case]
    serial = got["serial"]
    assert set(serial) == {"scrambled0", "scrambled1", "scrambled2", "missing", "best_swapped", "garbage"}
    for variant in VARIANTS:
        assert got[variant] == serial, (case, variant)
    assert [serial[f"scrambled{s}"] for s in range(DRAWS)] == child["scrambled"][case]
    assert {n: serial[n] for n in child["broken"][case]} == child["broken"][case]


def test_a_slice_width_that_is_not_a_column_count_is_refused(child):
    assert "slice_columns must be a positive column count or None, got 0" in child["bad_slice"]


def test_k_zero_gives_an_empty_row(child):
    assert child["k_zero"] == [[-1, -1, -1, -1]]


def test_the_hook_runs_the_stock_op_then_the_repair(child):
    """`VLLM_QSA_DET_TOPK=repair`: patch 8's gate is on, the hook's mode is `repair` (EXACT_TOPK
    still wins), and the 0.30+ `_topk` replacement called the stock op once, then repaired its
    (scrambled) output into the reference."""
    assert child["gate"] == [True, "repair", "exact"]
    logits, vis, _, _ = case_inputs("ties_at_kth")
    assert child["hook"]["called"] == [64]
    assert child["hook"]["out"] == reference(logits, vis, 64, 64)


def test_refuses_what_it_cannot_write(child):
    assert "repair top-k writes int32 block indices" in child["refusal"]


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
row = {{"logits_ptr": "*fp32", "stride_row": "i64", "visible_ptr": "*i32", "out_ptr": "*i32", "stride_out": "i64"}}
tail = {{"columns": "i32", "k": "i32", "width": "i32"}}
scratch = {{"scratch_ptr": "*i64", "stride_scratch": "i64"}}
kernels = {{
    "serial": (q._repair_serial, {{**row, **tail, "SLOTS": "constexpr", "BLOCK": "constexpr"}},
               {{"SLOTS": 512, "BLOCK": q.BLOCK}}),
    "count": (q._repair_count, {{**row, **scratch, **tail, "SLOTS": "constexpr", "SLICE": "constexpr",
                                "BLOCK": "constexpr"}}, {{"SLOTS": 512, "SLICE": q.SLICE, "BLOCK": q.BLOCK}}),
    "write": (q._repair_write, {{**row, **scratch, **tail, "MAX_S": "constexpr", "SLICE": "constexpr",
                                "BLOCK": "constexpr"}}, {{"MAX_S": 64, "SLICE": q.SLICE, "BLOCK": q.BLOCK}}),
}}
for name, (fn, sig, consts) in kernels.items():
    ctx = ir.context(); ir.load_dialects(ctx); backend.load_dialects(ctx)
    mod = str(ASTSource(fn, sig, constexprs=consts).make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx))
    print("ttir", name, "tt.reduce" in mod, "tt.scan" in mod, "scf.if" in mod)
"""


def test_the_kernels_pass_the_real_compilers_front_end():
    """The interpreter accepts what the compiler refuses (run38); Triton's own front end lowers the
    repair's kernels to TTIR without a GPU: the serial pass (its min reduction, the write pass's
    scans and the certificate's branch to the radix select), the sliced count (reductions, under the branch that skips slices past the visible part)
    and the sliced write (the scans of the counts and of the slice, the certificate's branch)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", TTIR.format(src=str(ROOT / "src"))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ttir ")]
    assert lines == ["ttir serial True True True", "ttir count True False True", "ttir write True True True"], proc.stdout
