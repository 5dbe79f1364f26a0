"""Patch 8's radix top-k kernel (`_qsa_radix`, VLLM_QSA_DET_TOPK=radix) compiled for a real GPU.

The unit tier proves the kernel's logic through Triton's interpreter; here the compiled kernel must
give the same answers on the device: against the CPU reference (score descending, ties to the
lowest column, returned in column order, -1 past min(k, visible)) on random scores, heavy ties and
rows wider than the real model's (125,056 columns at max_model_len 500,000); the same output on
every call and inside a CUDA graph replay (the FULL decode regime), with the visible counts changed
between replays as a decode step changes them. Timing is lab/bench_step_kernels.py's job."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu tier)"),
]

K = 512  # indexer_budget 2048 / compress_ratio 4


def reference(logits, visible, k):
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    for r in range(logits.shape[0]):
        v = max(0, min(int(visible[r]), logits.shape[1]))
        kk = min(k, v)
        row = logits[r, :v].double()
        # stable sort on -score: equal scores keep column order, so ties go to the lowest column
        order = torch.sort(-row, stable=True).indices[:kk]
        out[r, :kk] = torch.sort(order).values.to(torch.int32)
    return out


def _radix():
    from flash_vllm.patches.p08_qsa_det_topk import radix as _qsa_radix

    return _qsa_radix.radix_block_topk


@pytest.mark.parametrize("columns,visible,ties", [
    (32_768, [2048, 8192, 32_768], False),       # max_model_len 131,072: contexts 8k, 32k, 128k
    (125_056, [2048, 32_768, 125_056], False),   # flash's CTX=500,000
    (125_056, [700, 4096, 90_000], True),        # integer scores: ties at the k-th value everywhere
    (4096, [0, 100, 511, 512, 513], False),      # visible around k
])
def test_compiled_kernel_matches_the_reference(columns, visible, ties):
    g = torch.Generator().manual_seed(columns + len(visible))
    scores = (torch.randint(-8, 8, (len(visible), columns), generator=g).float() if ties
              else torch.randn(len(visible), columns, generator=g))
    vis = torch.tensor(visible, dtype=torch.int32)
    out = torch.full((len(visible), K), 7, dtype=torch.int32, device="cuda")
    _radix()(scores.cuda(), vis.cuda(), out, K, columns)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference(scores, vis, K))


def test_same_answer_on_every_call_and_in_a_graph_replay():
    radix = _radix()
    rows, columns = 24, 125_056  # batch 8 x 3 decode positions
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(-4, 4, (rows, columns), generator=g).float().cuda()
    vis = torch.randint(1, columns, (rows,), generator=g).to(torch.int32).cuda()
    out = torch.zeros(rows, K, dtype=torch.int32, device="cuda")
    radix(scores, vis, out, K, columns)
    first = out.clone()
    for _ in range(5):
        out.fill_(0)
        radix(scores, vis, out, K, columns)
        assert torch.equal(out, first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        radix(scores, vis, out, K, columns)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        radix(scores, vis, out, K, columns)
    for step in range(3):
        vis.copy_(torch.randint(1, columns, (rows,), generator=g).to(torch.int32).cuda())
        out.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), reference(scores.cpu(), vis.cpu(), K)), f"replay {step}"
