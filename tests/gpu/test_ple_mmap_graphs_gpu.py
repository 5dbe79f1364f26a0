"""Patch 1's graph regime on a real GPU, without vLLM.

The gather guard both flavours call (`ple_mmap.gather_into`) placed as vLLM places it under
PIECEWISE graphs: a captured segment computes the ids into a static buffer, the eager gather fills
the persistent rows buffer, a second captured segment dequantises them as 0.29's PLE layer does
(`rows.to(bf16) * weight_scale.to(bf16)`). Replays give exactly the table's rows for new tokens each
step, and the Stager's own small graphs stay keyed on the one persistent buffer. Inside a plain
stream capture (a FULL graph) the gather refuses before touching the stream, and the device stays
usable. Run where a GPU exists: `tests/run gpu` (or `python -m pytest -m gpu tests/gpu`).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flash_vllm.patches import p01_ple_mmap as ple_mmap  # noqa: E402
from flash_vllm.ple.stager import Stager  # noqa: E402
from flash_vllm.ple.synth import reference_rows, write_checkpoint  # noqa: E402
from flash_vllm.ple.table import PLETable  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu tier)"),
]

HEADS, WIDTH, SCALE = 16, 160, 0.0123  # the real geometry; an F32 scale that is not a bf16 value


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    d = tmp_path_factory.mktemp("ple")
    write_checkpoint(d, rows_per_shard=4099, num_shards=5, last_rows=77, per_file=2, width=WIDTH, scale=SCALE,
                     scale_dtype="F32")
    return d, PLETable.from_checkpoint(d, layer=1)


def _reference(d, ids_cpu, scale_bf16):
    raw = torch.from_numpy(reference_rows(d, ids_cpu.numpy())).view(torch.float8_e4m3fn)
    return (raw.to(torch.bfloat16) * scale_bf16.cpu()).view(ids_cpu.shape[0], HEADS * WIDTH)


def _same(got, want):
    """Bit-identical, except NaN payloads (random fp8 bytes hold NaNs; conversions may differ)."""
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn)
    assert torch.equal(got[~gn].view(torch.int16), want[~wn].view(torch.int16))


class Piecewise:
    """segment A (graph) -> eager gather (the guard) -> segment B (graph), on static buffers."""

    def __init__(self, stager, n, num_rows):
        dev = "cuda"
        self.stager = stager
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.mult = torch.arange(1, HEADS + 1, dtype=torch.int64, device=dev) * 7919
        self.num_rows = num_rows
        self.ids = torch.zeros(n, HEADS, dtype=torch.int64, device=dev)
        self.rows = torch.empty(n, HEADS, WIDTH, dtype=torch.float8_e4m3fn, device=dev)  # persistent
        self.scale = torch.tensor([SCALE], dtype=torch.float32).to(torch.bfloat16).to(dev)  # 0.29's bf16 param
        self.out = torch.empty(n, HEADS * WIDTH, dtype=torch.bfloat16, device=dev)
        self.a, self.b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture
            self.seg_a()
            self.seg_b()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.a):
            self.seg_a()
        with torch.cuda.graph(self.b):
            self.seg_b()

    def seg_a(self):
        self.ids.copy_((self.tokens.unsqueeze(1) * self.mult) % self.num_rows)

    def gather(self):
        ple_mmap.gather_into(lambda device: self.stager, self.ids, self.rows, raw=True)

    def seg_b(self):
        self.out.copy_((self.rows.to(torch.bfloat16) * self.scale.to(torch.bfloat16)).flatten(-2))

    def step(self, tokens):
        self.tokens.copy_(tokens)
        self.a.replay()
        self.gather()
        self.b.replay()


@pytest.mark.parametrize("n", [8, 512])  # decode (128 rows: the Stager's graphs) / prefill (dedup)
def test_piecewise_replay_gives_the_table_rows(table, n):
    d, t = table
    stager = Stager(t, "cuda")
    pw = Piecewise(stager, n, t.num_rows)
    rng = np.random.default_rng(n)
    times = []
    for step in range(6):
        tokens = torch.from_numpy(rng.integers(0, 248_320, size=n))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pw.step(tokens.cuda())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        ids = (tokens.unsqueeze(1) * (torch.arange(1, HEADS + 1) * 7919)) % t.num_rows
        assert torch.equal(pw.ids.cpu(), ids)
        _same(pw.out, _reference(d, ids, pw.scale))
    if n * HEADS <= stager.graph_max_rows:
        # one graph per pinned slot: the destination is the one persistent buffer
        assert 1 <= len(stager._graphs) <= stager.n_slots
    print(f"piecewise step n={n}: first {times[0] * 1e3:.2f} ms, then median "
          f"{np.median(times[1:]) * 1e3:.3f} ms (graph A + eager gather + graph B, synced)")


def test_full_capture_refuses_and_the_device_stays_usable(table):
    d, t = table
    stager = Stager(t, "cuda")
    pw = Piecewise(stager, 8, t.num_rows)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="PIECEWISE"):
        with torch.cuda.graph(g):  # the whole forward in one stream capture: a FULL graph
            pw.seg_a()
            pw.gather()
            pw.seg_b()
    assert not torch.cuda.is_current_stream_capturing()
    tokens = torch.arange(8) * 31
    pw.step(tokens.cuda())
    torch.cuda.synchronize()
    ids = (tokens.unsqueeze(1) * (torch.arange(1, HEADS + 1) * 7919)) % t.num_rows
    _same(pw.out, _reference(d, ids, pw.scale))
