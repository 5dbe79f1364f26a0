"""Patch 8's repair mode (VLLM_QSA_DET_TOPK=repair) compiled for a real GPU, after the real stock op.

The unit tier proves the repair kernel's logic through Triton's interpreter on a simulated stock
output; here vLLM's own `torch.ops._C.cooperative_topk` / `persistent_topk` select first and
`_qsa_radix.repair_block_topk` rewrites their output, through patch 8's 0.30+ hook
(`_qsa_topk.make_hook(stock, "repair", ...)`). On integer scores (ties at the k-th value in every
row) the result must equal the radix kernel's and the CPU reference, be the same on 5 calls, and
inside a CUDA graph replay (the FULL decode regime) with the visible counts changed between replays.
Timing is lab/bench_step_kernels.py's job."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_qsa_radix_gpu import K, reference  # noqa: E402  the radix GPU test's reference and k

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu tier)"),
]

TOKEN_TOPK, RATIO = 2048, 4  # K = 2048 // 4 blocks
WORKSPACE_BYTES = 1024 * 1024  # qsa_indexer._TOPK_WORKSPACE_BYTES in 0.30+


def _stock_op(which: str):
    """The stock op: `dispatch` = the one stock `_topk` picks for <= 32 rows on this device
    (cooperative_topk on sm_90+ except sm_12x, else persistent_topk), or the op named."""
    pytest.importorskip("vllm._custom_ops", reason="vLLM's compiled ops (vllm._C) are not importable here")
    if which == "dispatch":
        major, minor = torch.cuda.get_device_capability()
        which = "cooperative_topk" if major * 10 + minor >= 90 and major != 12 else "persistent_topk"
    if not hasattr(torch.ops._C, which):
        pytest.skip(f"this vLLM build has no torch.ops._C.{which}")
    op = getattr(torch.ops._C, which)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")

    def stock(logits, visible_blocks, token_topk, compress_ratio, block_indices, topk_workspace):
        op(logits, visible_blocks, block_indices, workspace, token_topk // compress_ratio, logits.shape[1])

    return stock


def _repair_hook(which: str):
    from flash_vllm.patches.p05_qsa_exact_topk import hook as _qsa_topk

    return _qsa_topk.make_hook(_stock_op(which), "repair", "v0.30")


def _radix(scores, vis):
    from flash_vllm.patches.p08_qsa_det_topk import radix as _qsa_radix

    out = torch.full((scores.shape[0], K), 7, dtype=torch.int32, device="cuda")
    _qsa_radix.radix_block_topk(scores, vis, out, K, scores.shape[1])
    return out


def _ties(rows: int, columns: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, (rows, columns), generator=g).float()


@pytest.mark.parametrize("which", ["dispatch", "persistent_topk"])
@pytest.mark.parametrize("columns,visible", [
    (32_768, [2048, 8192, 32_768]),          # max_model_len 131,072: contexts 8k, 32k, 128k
    (125_056, [700, 4096, 90_000]),          # flash's CTX=500,000
    (4096, [0, 100, 511, 512, 513]),         # visible around k
])
def test_stock_then_repair_equals_radix_and_the_reference(which, columns, visible):
    hook = _repair_hook(which)
    scores = _ties(len(visible), columns, columns + len(visible)).cuda()
    vis = torch.tensor(visible, dtype=torch.int32, device="cuda")
    out = torch.full((len(visible), K), 7, dtype=torch.int32, device="cuda")
    hook(scores, vis, TOKEN_TOPK, RATIO, out, None)
    torch.cuda.synchronize()
    assert torch.equal(out, _radix(scores, vis))
    assert torch.equal(out.cpu(), reference(scores.cpu(), vis.cpu(), K))


@pytest.mark.parametrize("which", ["dispatch", "persistent_topk"])
def test_same_answer_on_every_call_and_in_a_graph_replay(which):
    hook = _repair_hook(which)
    rows, columns = 24, 125_056  # batch 8 x 3 decode positions
    g = torch.Generator().manual_seed(9)
    scores = _ties(rows, columns, 9).cuda()
    vis = torch.randint(1, columns, (rows,), generator=g).to(torch.int32).cuda()
    out = torch.zeros(rows, K, dtype=torch.int32, device="cuda")
    hook(scores, vis, TOKEN_TOPK, RATIO, out, None)
    first = out.clone()
    assert torch.equal(first, _radix(scores, vis))
    for _ in range(5):
        out.fill_(0)
        hook(scores, vis, TOKEN_TOPK, RATIO, out, None)
        assert torch.equal(out, first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        hook(scores, vis, TOKEN_TOPK, RATIO, out, None)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hook(scores, vis, TOKEN_TOPK, RATIO, out, None)
    for step in range(3):
        vis.copy_(torch.randint(1, columns, (rows,), generator=g).to(torch.int32).cuda())
        out.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _radix(scores, vis)), f"replay {step}"
        assert torch.equal(out.cpu(), reference(scores.cpu(), vis.cpu(), K)), f"replay {step}"


@pytest.mark.parametrize("slice_columns", [None, 512, 2048, 4096])
@pytest.mark.parametrize("scores_kind", ["ties", "continuous"])
def test_every_slicing_writes_what_the_serial_pass_writes(slice_columns, scores_kind):
    """The sliced repair (two launches over rows x slices, the default) against run43's one program
    per row, compiled: the same output element for element after the real stock op, at flash's row
    width with visible counts from 0 to the whole row, tie-heavy and continuous scores."""
    from flash_vllm.patches.p08_qsa_det_topk import radix as _qsa_radix

    stock = _stock_op("dispatch")
    rows, columns = 24, 125_056
    g = torch.Generator().manual_seed(17)
    scores = (_ties(rows, columns, 17) if scores_kind == "ties" else torch.randn(rows, columns, generator=g)).cuda()
    vis = torch.tensor([0, 1, 511, 512, 513, 2047, 2048, 2049, 4096, 8191, 32_768, columns]
                       + torch.randint(1, columns, (rows - 12,), generator=g).tolist(), dtype=torch.int32).cuda()
    base = torch.zeros(rows, K, dtype=torch.int32, device="cuda")
    stock(scores, vis, TOKEN_TOPK, RATIO, base, None)
    serial, sliced = base.clone(), base.clone()
    _qsa_radix.repair_block_topk(scores, vis, serial, K, columns, slice_columns=None)
    _qsa_radix.repair_block_topk(scores, vis, sliced, K, columns, slice_columns=slice_columns)
    torch.cuda.synchronize()
    assert torch.equal(sliced, serial)
    assert torch.equal(sliced.cpu(), reference(scores.cpu(), vis.cpu(), K))


@pytest.mark.parametrize("slice_columns", [None, 2048])
def test_a_stock_selection_that_dropped_candidates_is_repaired_exactly(slice_columns):
    """vllm#51782: the stock kernel can drop top-k candidates. Damaged stock outputs (a dropped slot,
    the best column swapped for the (k+1)-th, a row of -1) fail the certificate and the kernel finds
    the k-th key itself, compiled, in a graph replay too: the reference, not merely a well-formed row."""
    from flash_vllm.patches.p08_qsa_det_topk import radix as _qsa_radix

    stock = _stock_op("dispatch")
    rows, columns = 12, 125_056
    g = torch.Generator().manual_seed(23)
    scores = torch.randn(rows, columns, generator=g).cuda()
    vis = torch.tensor([600, 4096, 8192, 32_768, 90_000, columns] * 2, dtype=torch.int32).cuda()
    base = torch.zeros(rows, K, dtype=torch.int32, device="cuda")
    stock(scores, vis, TOKEN_TOPK, RATIO, base, None)
    torch.cuda.synchronize()
    ranked = torch.argsort(scores.masked_fill(torch.arange(columns, device="cuda")[None] >= vis[:, None].long(),
                                              float("-inf")), dim=1, descending=True)
    damaged = base.clone()
    for r in range(rows):
        kind = r % 3
        if kind == 0:
            damaged[r, K // 2] = -1
        elif kind == 1:
            best = int(ranked[r, 0])
            damaged[r] = torch.where(damaged[r] == best, ranked[r, K].to(torch.int32), damaged[r])
        else:
            damaged[r] = -1
    want = reference(scores.cpu(), vis.cpu(), K)
    out = damaged.clone()
    _qsa_radix.repair_block_topk(scores, vis, out, K, columns, slice_columns=slice_columns)
    torch.cuda.synchronize()
    assert not torch.equal(damaged.cpu().sort(dim=1).values, want.sort(dim=1).values)
    assert torch.equal(out.cpu(), want)
    graph = torch.cuda.CUDAGraph()
    out.copy_(damaged)
    _qsa_radix.repair_block_topk(scores, vis, out, K, columns, slice_columns=slice_columns)  # warm-up
    out.copy_(damaged)
    with torch.cuda.graph(graph):
        _qsa_radix.repair_block_topk(scores, vis, out, K, columns, slice_columns=slice_columns)
    out.copy_(damaged)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)
