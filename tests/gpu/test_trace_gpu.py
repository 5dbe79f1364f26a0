"""lab/decode/trace.py on a trace CUPTI really wrote: torch's profiler (CPU and CUDA activity, the
activities vLLM's worker profiler uses on CUDA) around steps annotated with vLLM's names. A decode
step replays one captured CUDA graph; a mixed step replays it and then launches eager work (a torch
op and a Triton kernel, which goes through the driver's launch call). The reader must give each
step its graph's kernels (Kineto links them to the cudaGraphLaunch by correlation), count the
eager launches, find the Triton kernel by name, and leave nothing unlinked.

Run where a GPU exists: `tests/run gpu` (or `python -m pytest -m gpu tests/gpu`).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from lab.decode import trace  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu tier)"),
]

DEC = "execute_context_0(0)_generation_1(3)"
MIX = "execute_context_1(25)_generation_1(3)"


@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 0.5, mask=mask)


def test_graph_kernels_and_eager_launches_land_in_their_steps(tmp_path):
    a = torch.randn(512, 512, device="cuda")
    b = torch.randn(512, 512, device="cuda")
    side = torch.randn(1 << 16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up before capture, as torch asks
        out = torch.relu(a @ b) + 1.0
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.relu(a @ b) + 1.0
    _scale_kernel[(side.numel() // 1024,)](side, side.numel(), BLOCK=1024)  # compiled before the profile
    torch.cuda.synchronize()

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name in (DEC, DEC, DEC, MIX, MIX, MIX):
            with record_function(name):
                g.replay()
                if name == MIX:
                    torch.add(out, 1.0, out=out)
                    _scale_kernel[(side.numel() // 1024,)](side, side.numel(), BLOCK=1024)
            torch.cuda.synchronize()  # the step's sampling wait
    path = tmp_path / "mixed-1_rank0.pt.trace.json"
    prof.export_chrome_trace(str(path))

    rows = trace.steps(trace.load(path))
    assert [r["name"] for r in rows] == [DEC] * 3 + [MIX] * 3
    graph_kernels = {r["gpu_events"] for r in rows if r["name"] == DEC}
    assert len(graph_kernels) == 1 and min(graph_kernels) >= 2, rows  # the GEMM and the elementwise ops, every replay
    for r in rows:
        assert r["graphs"] == 1 and r["unlinked"] == 0, r
        assert r["sync_ms"] > 0 and r["gpu_busy_ms"] > 0
    for r in rows:
        if r["name"] == DEC:
            assert r["eager"] == 0
        else:
            # the torch op (cudaLaunchKernel) and Triton's (the driver's cuLaunchKernel*)
            assert r["eager"] >= 2 and r["gpu_events"] == min(graph_kernels) + 2, r
            assert any("_scale_kernel" in k for k in r["by_kernel"]), r["by_kernel"]
    s = trace.summarize(path)
    assert s["unlinked"] == 0 and s["outside"] == 0, s
    d = trace.delta(s["classes"][DEC], s["classes"][MIX])
    assert d["figures"]["eager"] >= 2 and d["figures"]["gpu_events"] == 2
