"""PLE staging on a real GPU: bit-exact rows, dequant, expansion, pinned-slot reuse without a device sync.

Run where a GPU exists: `tests/run gpu` (or `python -m pytest -m gpu tests/gpu`).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flash_vllm.ple import native  # noqa: E402
from flash_vllm.ple.config import PLEConfig  # noqa: E402
from flash_vllm.ple.stager import Stager  # noqa: E402
from flash_vllm.ple.synth import reference_rows, write_checkpoint  # noqa: E402
from flash_vllm.ple.table import PLETable, PLETableError  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu tier)"),
]


@pytest.fixture(scope="module", params=[("F8_E4M3", "BF16"), ("F8_E5M2", "F32"), ("BF16", None)])
def ckpt(request, tmp_path_factory):
    dtype, scale_dtype = request.param
    d = tmp_path_factory.mktemp(dtype)
    write_checkpoint(d, rows_per_shard=4099, num_shards=9, last_rows=77, per_file=4, dtype=dtype,
                     scale=0.0546875 if scale_dtype else None, scale_dtype=scale_dtype or "BF16")
    return d


def _expected(d, ids, table, out_dtype):
    ref = torch.from_numpy(reference_rows(d, ids))
    raw = ref.view(getattr(torch, {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "BF16": "bfloat16"}[table.dtype]))
    val = raw.float() * (table.scale if table.scale is not None else 1.0)
    return raw.view(*ids.shape, -1), val.to(out_dtype).view(*ids.shape, -1)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same(got, want):
    """Bit-identical, except that NaN payloads may differ between CPU and CUDA conversions."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.is_floating_point() and got.element_size() > 1:
        gn, wn = torch.isnan(got), torch.isnan(want)
        assert torch.equal(gn, wn)
        ib = {2: torch.int16, 4: torch.int32}[got.element_size()]
        assert torch.equal(got.view(ib)[~gn], want.view(ib)[~wn])
    else:
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("graphs", [True, False])
# run38's sizes at its threshold (256), and the first prefill past the default (1025 rows)
@pytest.mark.parametrize("shape, dedup_min", [((16, 16), 256), ((33, 16), 256), ((65, 16), None)])
def test_distinct_ids_past_dedup_min_keep_their_order(ckpt, shape, dedup_min, graphs):
    """Deduplicated rows come in sorted-id order; with every id distinct the inverse is still
    needed (run38: 16-33-token prefills served permuted rows and greedy output left stock's)."""
    with PLETable.from_checkpoint(ckpt) as t:
        st = Stager(t, "cuda", out_dtype=torch.bfloat16, graph_max_rows=1024 if graphs else 0, dedup_min=dedup_min)
        assert int(np.prod(shape)) >= st.dedup_min  # the dedup side, or the test proves nothing
        rng = np.random.default_rng(shape[0])
        ids = rng.choice(t.num_rows, int(np.prod(shape)), replace=False).reshape(shape)
        raw_ref, want = _expected(ckpt, ids, t, torch.bfloat16)
        out = torch.empty(want.shape, dtype=torch.bfloat16, device="cuda")
        assert st.lookup(ids, out=out) is out
        _same(out, want)
        _same(st.lookup(torch.from_numpy(ids).cuda(), raw=True), raw_ref)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("shape", [(1,), (48,), (12, 16), (24, 16), (8192, 16)])  # (24, 16): c=8 x MTP=2
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_stage_bit_exact(ckpt, shape, out_dtype, graphs):
    od = getattr(torch, out_dtype)
    with PLETable.from_checkpoint(ckpt) as t:
        st = Stager(t, "cuda", out_dtype=od, max_rows=64, graph_max_rows=1024 if graphs else 0)
        rng = np.random.default_rng(sum(shape))
        out = None
        for _ in range(3):
            ids = rng.integers(0, t.num_rows, shape)
            flat = ids.reshape(-1)
            flat[: flat.size // 3] = flat[-(flat.size // 3):]
            flat[0], flat[-1] = t.num_rows - 1, 0
            raw_ref, want = _expected(ckpt, ids, t, od)
            got = st.lookup(ids)
            assert got.device.type == "cuda"
            _same(got, want)
            raw = st.lookup(torch.from_numpy(ids).cuda(), raw=True)  # ids on the GPU: D2H path
            _same(raw, raw_ref)
            if out is None or out.shape != want.shape:
                out = torch.empty(want.shape, dtype=od, device="cuda")  # persistent across steps
            assert st.lookup(ids, out=out) is out
            _same(out, want)
            _same(got, want)  # still intact after later lookups (no aliasing of static buffers)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_pinned_reuse_is_safe_under_a_busy_stream(ckpt, zero_copy):
    """Many lookups queued behind slow GPU work: each result must still be its own rows, which
    fails if a pinned slot were overwritten before its H2D copy (or zero-copy read) ran."""
    with PLETable.from_checkpoint(ckpt) as t:
        st = Stager(t, "cuda", max_rows=4096, zero_copy=zero_copy)
        assert all(b.is_pinned() for b in st._rows)
        rng = np.random.default_rng(7)
        big = torch.randn(8192, 8192, device="cuda")
        outs, wants = [], []
        for i in range(12):
            big = big @ big  # keep the stream busy so copies lag behind the host
            big = big / big.norm()
            ids = rng.integers(0, t.num_rows, (300, 16) if i % 2 else (48,))  # eager and graph paths
            outs.append(st.lookup(ids))
            wants.append(_expected(ckpt, ids, t, torch.bfloat16)[1])
        torch.cuda.synchronize()
        for o, w in zip(outs, wants):
            _same(o, w)


def test_out_of_range_on_gpu_path(ckpt):
    with PLETable.from_checkpoint(ckpt) as t:
        st = Stager(t, "cuda")
        with pytest.raises(IndexError):
            st.lookup(torch.tensor([0, t.num_rows], device="cuda"))


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("nat", [True, False])
@pytest.mark.parametrize("io", ["auto", "direct"])
def test_short_path_bit_exact_without_allocations(ckpt, nat, io, zero_copy):
    """The small-batch path (compiled or numpy gather into the pinned slot, one graph replay into
    the caller's buffer), cold (O_DIRECT or buffered) and warm: the same bits as table[ids], and
    once captured no device allocation and no new graph per lookup."""
    if nat and native.load() is None:
        pytest.skip(f"numba: {native.status()}")
    try:
        t = PLETable.from_checkpoint(ckpt, config=PLEConfig(native=nat, io=io))
    except PLETableError as e:
        pytest.skip(str(e))
    with t:
        st = Stager(t, "cuda", max_rows=256, zero_copy=zero_copy)
        rng = np.random.default_rng(11)
        out = torch.empty((48, t.head_dim), dtype=torch.bfloat16, device="cuda")
        for i in range(6):
            ids = rng.integers(0, t.num_rows, 48)
            ids[0], ids[1] = t.num_rows - 1, ids[2]
            want = _expected(ckpt, ids, t, torch.bfloat16)[1]
            if i % 3 == 0:
                t.drop_cache()
            assert st.lookup(ids, out=out) is out
            _same(out, want)
            _same(st.lookup(ids), want)  # a fresh tensor each call
        for _ in range(2):  # every slot has its graph for this buffer now
            st.lookup(ids, out=out)
        torch.cuda.synchronize()
        before, graphs = torch.cuda.memory_allocated(), len(st._graphs)
        for _ in range(20):
            st.lookup(ids, out=out)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before and len(st._graphs) == graphs
        _same(out, want)
        assert t.last_strategy == "take"  # warm by now
        assert st._graph_events is not None


def test_graph_records_the_slot_event(ckpt, monkeypatch):
    """Where torch can record an event inside a capture, the replay marks the slot free by itself:
    a lookup then makes no Event.record() call, and the slot's event still completes after the copy."""
    with PLETable.from_checkpoint(ckpt) as t:
        st = Stager(t, "cuda", max_rows=64)
        ids = np.arange(48) * 7
        out = torch.empty((48, t.head_dim), dtype=torch.bfloat16, device="cuda")
        st.lookup(ids, out=out)
        st.lookup(ids, out=out)  # both slots captured (a capture itself records: wait_stream, the node)
        if not st._graph_events:
            pytest.skip("this torch cannot record external events in a capture")
        calls = []
        orig = torch.cuda.Event.record
        monkeypatch.setattr(torch.cuda.Event, "record", lambda self, *a: (calls.append(1), orig(self, *a))[1])
        for _ in range(4):
            st.lookup(ids, out=out)
        assert calls == []
        monkeypatch.undo()
        torch.cuda.synchronize()
        assert all(e is None or e.query() for e in st._events)
        _same(out, _expected(ckpt, ids, t, torch.bfloat16)[1])
