"""Patch 1's hoisted mode on a real GPU: rows staged before the forward, read by a FULL graph.

The runtime pieces of `ple_hoist` (the per-step `Hoister.stage`, the storage's `Slot`) driven as
vLLM 0.33's runner drives them, around one plain stream capture of the whole "forward" (a FULL
CUDA graph): per step the previous step's GPU work writes the next tokens into the static input
buffer (behind a long kernel, so the hook's one device-to-host copy must wait for it), the hook
computes the n-gram ids, gathers the rows through the guarded eager gather (`ple_mmap.gather_into`,
the engine's Stager) into the persistent buffer, then the FULL graph replays. Over several steps of
MTP-shaped decode batches (3 tokens per request, EOS inside) the graph's output equals,
bit for bit, the eager path's rows for the same ids and the table's rows for ids from flash's own
hashing of each request's history.

The ids: vLLM's Triton kernel (`ple_ngram_ids`) when vLLM 0.33 is importable (then the FULL graph
also computes the ids in-graph, as the real forward does), else flash's numpy hashing moved to the
device. Run where a GPU exists: `tests/run gpu` (or `python -m pytest -m gpu tests/gpu`).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flash_vllm.patches.p01_ple_mmap import hoist as ple_hoist  # noqa: E402
from flash_vllm.patches import p01_ple_mmap as ple_mmap  # noqa: E402
from flash_vllm.ple.hashing import PLELayout, ngram_ids, ngram_ids_batch  # noqa: E402
from flash_vllm.ple.stager import Stager  # noqa: E402
from flash_vllm.ple.synth import reference_rows, write_checkpoint  # noqa: E402
from flash_vllm.ple.table import PLETable  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu tier)"),
]

VOCAB, EOS = 248_320, 248_044
CFG = dict(vocab_size=VOCAB, eos_token_id=EOS, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=1000,
           make_ngram_vocab_size_divisible_by=128, split_ngram_parts=8, ple_embed_dim=2560)
LAYOUT = PLELayout.from_config(CFG)
HEADS, WIDTH, SCALE = LAYOUT.num_heads, LAYOUT.head_dim, 0.0123  # 16 heads x 160: the real row shape
REQS, QLEN, MAX_TOKENS = 4, 3, 64  # 4 requests x (1 + 2 MTP drafts)


def _triton_ids():
    try:
        from vllm.models.qwen4_exp.common.ops.ple import ple_ngram_ids
    except Exception:  # noqa: BLE001 - any import failure means: no vLLM kernel on this box
        return None
    return ple_ngram_ids


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    d = tmp_path_factory.mktemp("ple-hoist")
    rps = 4099
    write_checkpoint(d, rows_per_shard=rps, num_shards=-(-LAYOUT.num_rows // rps), per_file=2, width=WIDTH,
                     scale=SCALE, scale_dtype="F32")
    return d, PLETable.from_checkpoint(d, layer=1)


class Storage:
    """The parts of patch 1's storage class the hoisted mode uses (`_flash_buffer`, `_gather_into`,
    `_flash_hoist`); the class itself needs vLLM."""

    def __init__(self, stager):
        self.stager = stager
        self._flash_out = None
        self._flash_rows = MAX_TOKENS
        self._flash_out_dtype = torch.bfloat16
        self.embedding_dim = WIDTH
        self._flash_hoist = ple_hoist.Slot()

    def _flash_buffer(self, n, heads_shape, device):
        out = self._flash_out
        if out is None or out.shape[0] < n or out.device != device:
            assert not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
            out = torch.zeros(max(self._flash_rows, n), *heads_shape, self.embedding_dim,
                              dtype=self._flash_out_dtype, device=device)
            self._flash_out = out
        return out

    def _gather_into(self, ids, out):
        ple_mmap.gather_into(lambda device: self.stager, ids, out)


class NGram(torch.nn.Module):
    """Qwen4ExpNGramEmbedding's surface the hook uses: compute_ngram_ids + ngram_embedding."""

    def __init__(self, stager, kernel):
        super().__init__()
        self.ngram_embedding = Storage(stager)
        self.kernel = kernel
        dev = "cuda"
        self.mult = torch.tensor(LAYOUT.multipliers, dtype=torch.long, device=dev)
        self.sizes = torch.tensor(LAYOUT.head_sizes, dtype=torch.long, device=dev)
        self.offs = torch.tensor(LAYOUT.head_offsets, dtype=torch.long, device=dev)

    def compute_ngram_ids(self, input_ids, query_start_loc, ngram_context, output=None):
        if self.kernel is not None:
            return self.kernel(input_ids=input_ids, query_start_loc=query_start_loc, ngram_context=ngram_context,
                               layer_multipliers=self.mult, ngram_heads_vocab_sizes=self.sizes,
                               ngram_heads_offsets=self.offs, eos_token_id=EOS,
                               heads_per_ngram=LAYOUT.heads_per_ngram, output=output)
        ids = ngram_ids_batch(input_ids.cpu().numpy(), query_start_loc[:REQS + 1].cpu().numpy(), LAYOUT,
                              ngram_context[:REQS].cpu().numpy())
        return torch.from_numpy(ids).to(input_ids.device)


class Rig:
    """Static buffers, the hook and one FULL capture of the forward's PLE part."""

    def __init__(self, stager, kernel):
        dev = "cuda"
        self.n = REQS * QLEN
        self.mod = NGram(stager, kernel)
        self.model = torch.nn.ModuleDict({"ple": self.mod})
        self.input_ids = torch.zeros(self.n, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(0, self.n + 1, QLEN, dtype=torch.int32, device=dev)
        self.ctx = torch.full((REQS, 2), EOS, dtype=torch.int32, device=dev)
        self.ids_static = torch.zeros(self.n, HEADS, dtype=torch.long, device=dev)
        self.out = torch.empty(self.n, HEADS * WIDTH, dtype=torch.bfloat16, device=dev)
        self.hoister = ple_hoist.Hoister(self.model)
        assert self.hoister.layers == [self.mod]
        self.req_states = SimpleNamespace(req_id_to_index={f"r{i}": i for i in range(REQS)})
        self.batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(REQS)], input_ids=self.input_ids)
        # the profile run's allocation, on the device the forward's ids live on ("cuda:0", not "cuda")
        self.mod.ngram_embedding._flash_buffer(self.n, (HEADS,), self.ids_static.device)
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):  # one plain stream capture: a FULL graph
            self.forward()

    def forward(self):
        """What the patched forward does in hoisted mode: ids (in-graph with the Triton kernel), the
        buffer read through the Slot (no gather), the layer's dequant-side consumer."""
        if self.mod.kernel is not None:
            ids = self.mod.compute_ngram_ids(self.input_ids, self.qsl, self.ctx, output=self.ids_static)
        else:
            ids = self.ids_static
        rows = self.mod.ngram_embedding._flash_hoist.read(self.mod.ngram_embedding, ids)
        self.out.copy_(rows.flatten(-2))

    def step(self, next_tokens_dev):
        # the previous step's GPU work: a long kernel, then it writes the tokens of this step
        torch.cuda._sleep(2_000_000)
        self.input_ids.copy_(next_tokens_dev, non_blocking=True)
        t0 = time.perf_counter()
        self.hoister.stage(self.batch, self.req_states, {"query_start_loc": self.qsl, "ngram_context": self.ctx})
        t1 = time.perf_counter()
        self.graph.replay()
        return t1 - t0


def _same(got, want):
    """Bit-identical, except NaN payloads (random fp8 bytes hold NaNs; conversions may differ)."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn)
    assert torch.equal(got[~gn].view(torch.int16), want[~wn].view(torch.int16))


def _reference(d, ids):
    raw = torch.from_numpy(reference_rows(d, ids)).view(torch.float8_e4m3fn)
    return (raw.float() * SCALE).to(torch.bfloat16).view(ids.shape[0], HEADS * WIDTH)


@pytest.mark.parametrize("kernel", ["triton", "numpy"])
def test_full_graph_replays_the_hoisted_rows(table, kernel):
    d, t = table
    fn = _triton_ids() if kernel == "triton" else None
    if kernel == "triton" and fn is None:
        pytest.skip("vLLM 0.33's ple_ngram_ids is not importable here (the numpy case covers the hook)")
    stager = Stager(t, "cuda")
    rig = Rig(stager, fn)
    eager_buf = torch.empty(rig.n, HEADS, WIDTH, dtype=torch.bfloat16, device="cuda")
    rng = np.random.default_rng(12)
    hist = [list(rng.integers(0, VOCAB, size=int(rng.integers(0, 4)))) for _ in range(REQS)]
    times = []
    for step in range(8):
        q = rng.integers(0, VOCAB, size=(REQS, QLEN))
        q[rng.random((REQS, QLEN)) < 0.2] = EOS
        ctx = np.array([([EOS, EOS] + h)[-2:] for h in hist], dtype=np.int64)
        rig.ctx.copy_(torch.from_numpy(ctx))
        tokens = torch.from_numpy(q.reshape(-1).astype(np.int32)).cuda()
        times.append(rig.step(tokens))
        torch.cuda.synchronize()
        want_ids = np.concatenate([ngram_ids(q[r], LAYOUT, context=ctx[r]) for r in range(REQS)])
        if fn is not None:
            assert np.array_equal(rig.ids_static.cpu().numpy(), want_ids)  # the in-graph kernel agrees
        hoisted = rig.out.clone()
        # the eager path for the same step: the guarded gather of the device ids, outside any graph
        ple_mmap.gather_into(lambda device: stager, torch.from_numpy(want_ids).cuda(), eager_buf)
        torch.cuda.synchronize()
        _same(hoisted, eager_buf.flatten(-2))
        _same(hoisted, _reference(d, want_ids))
        # MTP: a random number of the step's tokens is accepted into the history
        for r in range(REQS):
            hist[r] += list(q[r, :int(rng.integers(1, QLEN + 1))])
    assert rig.mod.ngram_embedding._flash_hoist.steps == 8 and rig.hoister.step == 8
    print(f"hoisted staging ({kernel} ids, {rig.n} tokens x {HEADS} heads): first {times[0] * 1e6:.0f} us, "
          f"then median {np.median(times[1:]) * 1e6:.0f} us (includes the wait for the previous step)")


def test_capture_reads_without_checks_and_eager_reads_check_the_count(table):
    d, t = table
    rig = Rig(Stager(t, "cuda"), None)
    slot = rig.mod.ngram_embedding._flash_hoist
    slot.staged_n = rig.n + 1  # stale: a capture does not check (it records), an eager read does
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rig.forward()
    with pytest.raises(RuntimeError, match=f"staged {rig.n + 1}"):
        rig.forward()
