"""Patch 1 (PLE from mmap) with the real vLLM classes, on CPU.

0.30+ ("storage" flavour): `check()` passes on the release's source, `apply()` replaces both
storage classes (and every stale binding) and is idempotent, and the patched class built by
vLLM's own constructor (real fp8 quant method, real ETP/TP groups of size 1 over gloo) has no
table storage (`meta` weight), ignores the shard rows at load time and returns exactly
`table[ids] * scale` of a small synthetic checkpoint read from disk by the PLE engine.

0.29 ("splitting-op" flavour, the `test_v029_*` checks): the release's own
`Qwen4ExpNGramEmbedding` built with the patch on (Fp8Config and no quant config, the ModelOpt
case) has a meta table, the stock `load_weights` skips the shard rows and loads the scale into a
real buffer, our op `vllm::flash_ple_mmap_lookup` is registered and listed as a splitting op,
and the patched forward returns the table's bytes, which 0.29's own `_dequantize_embeddings`
turns into exactly what the unpatched (GPU-table) layer returns. Capture semantics as on 0.30+.

On bases without code: `check()` refuses (the registry says not-ported there).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

NGRAM = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
PREFIX = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"
ROWS, LAST, SHARDS, WIDTH = 50, 30, 4, 32
NUM_ROWS = ROWS * (SHARDS - 1) + LAST


def _ctx():
    from flash_vllm import compat
    from flash_vllm.registry import Context

    return Context(compat.resolve(compat.installed_vllm_version(), {}), {"VLLM_PLE_MMAP": "1"})


@pytest.fixture(scope="module")
def patch1():
    from flash_vllm.registry import by_number

    return by_number(1)


def test_not_ported_bases_refuse(patch1, base):
    if patch1.meant_for(base):
        patch1.check(_ctx())  # the source anchors hold on a base we ship code for
        return
    from flash_vllm.registry import TargetMissing

    assert base in patch1.not_ported
    with pytest.raises(TargetMissing):
        patch1.check(_ctx())


def cpu_capture(monkeypatch):
    """The release's own BreakableCUDAGraphCapture with only its two CUDA calls stubbed (segment
    begin/end): its real `__enter__` (the thread-local `current()`) and `add_eager` (end the
    segment, run the eager function once at capture time, record it, begin the next segment) drive
    the patch as a real capture does. Issue 11: an earlier stand-in kept `_capturing` True during
    the eager run, which the real `add_eager` sets False, and so hid the boot failure."""
    from vllm.compilation import breakable_cudagraph as bc

    class CpuCapture(bc.BreakableCUDAGraphCapture):
        def _begin_segment(self):
            self._capturing = True

        def _end_segment(self):
            if self._capturing:
                self.segments.append(lambda: None)  # a captured graph segment: nothing to replay here
                self._num_graphs += 1
                self._capturing = False

    monkeypatch.setattr(bc, "_weak_ref_capture_arg", lambda a: a, raising=False)  # weak refs need vllm._C
    monkeypatch.setattr(bc, "weak_ref_tensor", lambda a: a, raising=False)
    return CpuCapture()


def _flavour(base):
    from flash_vllm.patches import p01_ple_mmap as ple_mmap

    return ple_mmap.FLAVOURS.get(base)


@pytest.fixture(scope="module")
def applied(patch1, base, restore_ple_storage):
    if _flavour(base) != "storage":
        yield None
        return
    ng = importlib.import_module(NGRAM)
    # where the storage classes are defined: nvidia/ngram_embedding on 0.30, common/ on 0.31+
    common = importlib.import_module(ng.Qwen4ExpPLEPinnedHostEmbedding.__module__)
    stock = (ng.Qwen4ExpPLEPinnedHostEmbedding, ng.Qwen4ExpPLEDeviceEmbedding)
    ctx = _ctx()
    patch1.check(ctx)
    patch1.apply(ctx)
    first = (ng.Qwen4ExpPLEPinnedHostEmbedding, ng.Qwen4ExpPLEDeviceEmbedding)
    patch1.apply(ctx)
    patch1.verify(ctx)
    patch1.check(ctx)  # still passes after apply (anchors read from the originals)
    yield SimpleNamespace(ng=ng, common=common, stock=stock, first=first)
    restore_ple_storage(ng, stock)  # check_ple_mmap_forward.py builds its stock side from these names


def test_apply_swaps_storage_classes_idempotently(applied, base, patch1):
    if applied is None:
        assert _flavour(base) != "storage"
        return
    ng, common = applied.ng, applied.common
    pinned, device = ng.Qwen4ExpPLEPinnedHostEmbedding, ng.Qwen4ExpPLEDeviceEmbedding
    assert (pinned, device) == applied.first          # the second apply changed nothing
    assert pinned.__flash_patch__ == device.__flash_patch__ == 1
    assert pinned is not device
    assert pinned.__flash_original__ is applied.stock[0] and device.__flash_original__ is applied.stock[1]
    assert common.Qwen4ExpPLEPinnedHostEmbedding is pinned  # stale binding rebound (0.31+)
    assert common.Qwen4ExpPLEDeviceEmbedding is device
    assert issubclass(pinned, common.Qwen4ExpPLEEmbedding)
    assert not issubclass(pinned, applied.stock[0])       # nothing of the pinned allocation inherited


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from flash_vllm.ple import synth

    d = tmp_path_factory.mktemp("ple-ckpt")
    synth.write_checkpoint(d, layout="nvidia", rows_per_shard=ROWS, num_shards=SHARDS, last_rows=LAST,
                           width=WIDTH)
    return d


@pytest.fixture(scope="module")
def layer(applied, checkpoint, tmp_path_factory, cpu_world):
    """The patched pinned-host class built as Qwen4ExpNGramEmbedding builds it (fp8 checkpoint)."""
    if applied is None:
        yield None
        return
    with cpu_world(tmp_path_factory, checkpoint):  # the model path is what the patch reads
        method = applied.common.Qwen4ExpPLEEmbeddingMethod.from_quant_config(None, PREFIX, "float8_e4m3fn")
        emb = applied.ng.Qwen4ExpPLEPinnedHostEmbedding(
            NUM_ROWS, WIDTH, params_dtype=torch.bfloat16, padding_size=4, prefix=PREFIX,
            embedding_method=method, num_ngram_heads=2, max_total_tokens=16)
        yield SimpleNamespace(emb=emb, method=method)


def _reference(checkpoint, ids):
    from flash_vllm.ple import PLETable

    t = PLETable.from_checkpoint(checkpoint, layer=1)
    raw = torch.from_numpy(t.gather(ids.numpy()).copy()).view(torch.float8_e4m3fn)
    return (raw.float() * t.scale).to(torch.bfloat16).view(*ids.shape, WIDTH)


def test_lookup_returns_table_rows_without_storage(layer, checkpoint, base, patch1):
    if layer is None:
        assert _flavour(base) != "storage"
        return
    emb = layer.emb
    assert type(layer.method).__name__ == "Qwen4ExpPLEFp8EmbeddingMethod"
    assert emb.weight.device.type == "meta" and tuple(emb.weight.shape) == (NUM_ROWS, WIDTH)
    assert emb.weight.dtype == torch.float8_e4m3fn
    # load time: a shard's rows are dropped (no storage to copy into), nothing raises
    emb.weight_loader(emb.weight, torch.zeros(ROWS, WIDTH, dtype=torch.float8_e4m3fn), checkpoint_start=0)
    assert emb.weight.device.type == "meta"
    rng = np.random.default_rng(0)
    for n in (1, 3, 16):
        ids = torch.from_numpy(rng.integers(0, NUM_ROWS, size=(n, 2)))
        ids[0, 0] = NUM_ROWS - 1  # a row of the partial last shard
        out = emb(ids)
        want = _reference(checkpoint, ids)
        assert out.shape == (n, 2, WIDTH) and out.dtype == torch.bfloat16
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))  # bitwise (fp8 NaNs included)
        assert emb.dequantize(out, torch.bfloat16) is out or torch.equal(
            emb.dequantize(out, torch.bfloat16).view(torch.int16), out.view(torch.int16))
    # one persistent buffer of max_total_tokens rows: every result is a view of it
    buf = emb._flash_out
    assert buf.shape == (16, 2, WIDTH)
    assert emb(ids[:2]).untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    from flash_vllm.patches import p01_ple_mmap as ple_mmap

    total = ple_mmap.TABLES.stats.snapshot()["total"]
    assert total["ops"] >= 4 and total["rows"] >= 1 + 3 * 2 + 16 * 2  # one op per lookup, every row


def test_capture_time_run_zero_fills(layer, checkpoint, base, patch1, monkeypatch):
    """During a breakable capture the eager segment runs once with recorded (garbage) ids: it
    must not read the table (ids may be out of range) and leaves zeros; the recorded segment,
    replayed outside the capture on the same static buffers, gathers the real rows."""
    if layer is None:
        assert _flavour(base) != "storage"
        return
    emb = layer.emb
    ids = torch.full((4, 2), 1 << 40, dtype=torch.long)  # the static ids buffer, garbage at capture
    with pytest.raises(IndexError):
        emb(ids)  # outside a capture the engine range-checks the ids
    cap = cpu_capture(monkeypatch)
    emb._flash_out.fill_(7)
    with cap:
        out = emb(ids)  # the eager segment's capture-time run: ids never computed
    assert out.shape == (4, 2, WIDTH) and not out.any()
    # the gather is an eager break exactly when the decorator was active at layer init
    # (VLLM_USE_BREAKABLE_CUDAGRAPH, which VllmConfig sets for Qwen4Exp)
    wrapped = getattr(emb._flash_gather, "__wrapped__", None) is not None
    assert cap.num_eager_breaks == (1 if wrapped else 0)
    if wrapped:
        ids.copy_(torch.tensor([[0, 1], [NUM_ROWS - 1, 5], [60, 61], [100, 2]]))
        cap.replay()  # outside the capture context: the eager segment gathers the real rows
        assert torch.equal(out.view(torch.int16), _reference(checkpoint, ids).view(torch.int16))


# --- 0.29: the splitting-op flavour ----------------------------------------------------------------

V029_LAYER = "model.language_model.layers.1.ple"
V029_PREFIX = f"{V029_LAYER}.ple_embedding"
# A tiny qwen4_exp n-gram layout: 2 heads (61 + 67 rows) padded to 128, head_dim 32, three shards
# of 43 rows with a partial last one (42), as 0.29's load_weights splits them.
V029_CFG = dict(ngram_size=3, heads_per_ngram=1, eos_token_id=7, vocab_size=64, split_ngram_parts=3, seed=1234,
                ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=4)
V029_ROWS, V029_SHARD, V029_WIDTH = 128, 43, 32
V029_SCALE = 0.0123  # F32 in the checkpoint, not a bf16 value: 0.29 rounds it into a bf16 parameter


def _v029_shards(checkpoint):
    """The checkpoint's tensors as vLLM's iterator yields them to Qwen4ExpNGramEmbedding.load_weights."""
    from flash_vllm.ple import synth

    out = []
    for k in range(3):
        ids = np.arange(k * V029_SHARD, min((k + 1) * V029_SHARD, V029_ROWS))
        rows = torch.from_numpy(synth.reference_rows(checkpoint, ids).copy()).view(torch.float8_e4m3fn)
        out.append((f"ngram_embedding.shard_{k}.weight", rows))
    out.append(("ngram_embedding.weight_scale", torch.tensor([V029_SCALE], dtype=torch.float32)))
    return out


def _v029_inputs(n_tokens=(5, 3, 1)):
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(0, 64, size=sum(n_tokens)))
    if ids.numel() > 2:
        ids[2] = V029_CFG["eos_token_id"]  # EOS segmentation inside a request
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(n_tokens)]), dtype=torch.int32)
    ctx = torch.from_numpy(rng.integers(0, 64, size=(len(n_tokens), 2)))
    return ids, qsl, ctx


@pytest.fixture(scope="module")
def v029(patch1, base, tmp_path_factory, cpu_world):
    """Stock layer (built and loaded before the patch), then the patch applied twice, then patched
    layers with an Fp8Config and without a quant config; all on the session's CPU VllmConfig."""
    if _flavour(base) != "splitting-op":
        yield None
        return
    from flash_vllm.ple import synth
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    pl = importlib.import_module("vllm.models.qwen4_exp.nvidia.ple_layer")
    ckpt = tmp_path_factory.mktemp("ple-ckpt-029")
    synth.write_checkpoint(ckpt, layout="radixark", rows_per_shard=V029_SHARD, num_shards=3,
                           last_rows=V029_ROWS - 2 * V029_SHARD, width=V029_WIDTH, scale=V029_SCALE,
                           scale_dtype="F32", per_file=2)
    config = SimpleNamespace(**V029_CFG)
    fp8 = Fp8Config(is_checkpoint_fp8_serialized=True)

    def build(quant_config, prefix=V029_PREFIX, layer_name=V029_LAYER):
        return pl.Qwen4ExpNGramEmbedding(config, 2 * V029_WIDTH, 1, 16, 4, prefix=prefix, layer_name=layer_name,
                                         quant_config=quant_config, params_dtype=torch.bfloat16)

    # the model path is what the patch reads
    with cpu_world(tmp_path_factory, ckpt, cfg=get_current_vllm_config()) as cfg:
        stock = build(fp8)
        stock_loaded = stock.load_weights(_v029_shards(ckpt))
        stock_cls = pl.PLEVocabParallelEmbedding
        ops_before = list(type(cfg.compilation_config)._attention_ops)
        ctx = _ctx()
        patch1.check(ctx)
        patch1.apply(ctx)
        first = (pl.PLEVocabParallelEmbedding, pl.Qwen4ExpNGramEmbedding.forward)
        patch1.apply(ctx)
        patch1.verify(ctx)
        patch1.check(ctx)  # still passes after apply (anchors read from the originals)
        ours = build(fp8)
        ours_loaded = ours.load_weights(_v029_shards(ckpt))
        plain = build(None)  # ModelOpt checkpoints reach 0.29's layer with no fp8 method
        plain.load_weights(_v029_shards(ckpt))
        yield SimpleNamespace(pl=pl, ckpt=ckpt, cfg=cfg, build=build, stock=stock, stock_loaded=stock_loaded,
                              stock_cls=stock_cls, ops_before=ops_before, first=first, ours=ours,
                              ours_loaded=ours_loaded, plain=plain)


def _v029_forward(v, layer, inputs):
    """The layer's forward as the model calls it: the ops find it in the forward context."""
    from vllm.forward_context import set_forward_context

    sfc = v.cfg.compilation_config.static_forward_context
    sfc[V029_LAYER] = SimpleNamespace(ple_embedding=layer)
    try:
        with set_forward_context(None, v.cfg):
            return layer(*inputs)
    finally:
        sfc.pop(V029_LAYER, None)


def _v029_dequant(v, layer, rows):
    """0.29's own Qwen4ExpPLELayer._dequantize_embeddings on `layer`'s table module."""
    holder = SimpleNamespace(ple_embedding=layer)
    holder._get_embedding_weight_scale = lambda: v.pl.Qwen4ExpPLELayer._get_embedding_weight_scale(holder)
    return v.pl.Qwen4ExpPLELayer._dequantize_embeddings(holder, rows, torch.bfloat16)


def test_v029_flavour_matches_base(base, v029):
    """Patch 1's flavour is the catalogue's, and the splitting-op one is what this release's source has."""
    import importlib.util
    from pathlib import Path

    from flash_common import releases

    splitting = releases.cap(base, "ple_storage") == "splitting-op"
    assert (v029 is not None) == splitting == (_flavour(base) == "splitting-op")
    layer = importlib.util.find_spec("vllm.models.qwen4_exp.nvidia.ple_layer")  # read, not imported
    src = Path(layer.origin).read_text() if layer else ""
    assert splitting == ("PLEVocabParallelEmbedding" in src and "qwen4_exp_compute_ple_ngram_ids" in src)


def test_v029_apply_is_idempotent_and_lists_our_splitting_op(v029):
    if v029 is None:
        return
    from flash_vllm.patches.p01_ple_mmap import v029 as m
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode

    pl = v029.pl
    common = importlib.import_module("vllm.models.qwen4_exp.common.ple")
    assert (pl.PLEVocabParallelEmbedding, pl.Qwen4ExpNGramEmbedding.forward) == v029.first
    assert pl.PLEVocabParallelEmbedding.__flash_patch__ == 1
    assert pl.PLEVocabParallelEmbedding.__flash_original__ is v029.stock_cls
    assert common.PLEVocabParallelEmbedding is pl.PLEVocabParallelEmbedding  # stale binding rebound
    assert issubclass(pl.PLEVocabParallelEmbedding, v029.stock_cls)
    assert hasattr(torch.ops.vllm, m.OP_NAME)
    ops = CompilationConfig._attention_ops
    assert m.SPLIT_OP not in v029.ops_before and ops.count(m.SPLIT_OP) == 1
    assert ops[:len(v029.ops_before)] == v029.ops_before  # appended, nothing else touched
    # what 0.29 does with it: splitting_ops unset -> a copy of the list, ours included
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="PIECEWISE")
    cc.splitting_ops = None
    cc.set_splitting_ops_for_v1("allgather_reducescatter")
    assert m.SPLIT_OP in cc.splitting_ops and m.STOCK_SPLIT_OP in cc.splitting_ops


def test_v029_table_is_meta_and_loader_skips_the_shards(v029):
    if v029 is None:
        return
    stock_emb = v029.stock.ngram_embedding
    assert stock_emb.weight.device.type == "cpu" and stock_emb.weight.dtype == torch.float8_e4m3fn  # the stock table
    for layer in (v029.ours, v029.plain):
        emb = layer.ngram_embedding
        assert type(emb).__name__ == "FlashMmapPLEVocabParallelEmbedding"
        assert emb.weight.is_meta and tuple(emb.weight.shape) == (V029_ROWS, V029_WIDTH)
        # nothing of the module holds table storage: the only real tensor is the scale
        real = {n: t for n, t in list(emb.named_parameters()) + list(emb.named_buffers()) if not t.is_meta}
        assert set(real) == {"weight_scale"} and real["weight_scale"].numel() == 1
        assert emb.flash_rows_dtype == torch.float8_e4m3fn and emb.flash_cast_to is None
        # loaded like the stock parameter: F32 checkpoint value rounded into bf16, same bits
        assert emb.weight_scale.dtype == stock_emb.weight_scale.dtype == torch.bfloat16
        assert torch.equal(emb.weight_scale.view(torch.int16), stock_emb.weight_scale.data.view(torch.int16))
    assert v029.ours_loaded == v029.stock_loaded
    assert {"ngram_embedding.weight", "ngram_embedding.weight_scale"} <= v029.ours_loaded
    # a shard handed straight to the weight loader is dropped, not copied (no storage to copy into)
    emb = v029.ours.ngram_embedding
    emb.weight.weight_loader(emb.weight, torch.ones(V029_SHARD, V029_WIDTH).to(torch.float8_e4m3fn),
                             checkpoint_start=0)
    assert emb.weight.is_meta


def test_v029_rows_are_the_tables_and_dequantise_as_029(v029):
    if v029 is None:
        return
    from flash_vllm.patches import p01_ple_mmap as ple_mmap
    from flash_vllm.ple import synth

    before = ple_mmap.TABLES.stats.snapshot()["total"]["ops"]
    for n_tokens in ((5, 3, 1), (1,), (9, 7)):
        inputs = _v029_inputs(n_tokens)
        want_ids = v029.stock.compute_ngram_ids(*inputs)
        assert int(want_ids.max()) < V029_ROWS
        stock_rows = _v029_forward(v029, v029.stock, inputs)   # stock: ids op + F.embedding of the GPU table
        stock_out = _v029_dequant(v029, v029.stock, stock_rows)
        for layer in (v029.ours, v029.plain):
            rows = _v029_forward(v029, layer, inputs)
            n = sum(n_tokens)
            assert rows.shape == (n, 2 * V029_WIDTH) and rows.dtype == torch.float8_e4m3fn
            table = synth.reference_rows(v029.ckpt, want_ids.numpy()).reshape(n, -1)
            assert np.array_equal(rows.view(torch.uint8).numpy(), table)  # the table's bytes
            out = _v029_dequant(v029, layer, rows)  # 0.29's own dequantisation, our scale buffer
            assert out.dtype == torch.bfloat16
            assert torch.equal(out.view(torch.int16), stock_out.view(torch.int16))  # bitwise, NaNs included
    emb = v029.ours.ngram_embedding
    # a prefill-sized batch straight through the op's lookup: the Stager's dedup + expand path
    big = torch.from_numpy(np.random.default_rng(2).integers(0, V029_ROWS, size=(600, 2)))  # > dedup_min rows
    out = torch.empty(600, 2, V029_WIDTH, dtype=torch.float8_e4m3fn)
    emb.flash_lookup(big, out)
    assert big.numel() >= emb._flash_stager.dedup_min  # the dedup side, or this proves nothing new
    want = synth.reference_rows(v029.ckpt, big.numpy()).reshape(600, 2, V029_WIDTH)
    assert np.array_equal(out.view(torch.uint8).numpy(), want)
    buf = emb._flash_out
    # max_num_batched_tokens rows (what 0.29 passes the layer as max_total_tokens), allocated once
    assert buf.shape == (v029.cfg.scheduler_config.max_num_batched_tokens, 2, V029_WIDTH)
    _v029_forward(v029, v029.ours, _v029_inputs((2,)))
    assert emb._flash_out is buf
    assert ple_mmap.TABLES.stats.snapshot()["total"]["ops"] >= before + 7  # one op per lookup
    with pytest.raises(RuntimeError, match="flash_ple_mmap_lookup"):
        emb(torch.zeros(2, 2, dtype=torch.long))  # nothing reads the meta table the stock way


def test_v029_forward_compiles_to_one_graph_around_our_op(v029):
    """What vLLM's piecewise backend needs: dynamo traces the patched forward without a break and
    our op is a node of the FX graph (where the splitting-op list cuts it out); same rows."""
    if v029 is None:
        return
    from flash_vllm.patches.p01_ple_mmap import v029 as m
    from vllm.forward_context import set_forward_context

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layer = v029.ours
    inputs = _v029_inputs((4, 2))
    compiled = torch.compile(layer.forward, backend=backend, fullgraph=True, dynamic=False)
    sfc = v029.cfg.compilation_config.static_forward_context
    sfc[V029_LAYER] = SimpleNamespace(ple_embedding=layer)
    try:
        with set_forward_context(None, v029.cfg):
            got = compiled(*inputs)
    finally:
        sfc.pop(V029_LAYER, None)
        torch._dynamo.reset()
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any(m.OP_NAME in t for t in targets), targets
    assert not any("embedding" in t and m.OP_NAME not in t for t in targets), targets  # no F.embedding
    want = _v029_forward(v029, layer, inputs)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_v029_capture_zero_fills_replays_and_refuses_full(v029, monkeypatch):
    if v029 is None:
        return
    from flash_vllm.patches import p01_ple_mmap as ple_mmap
    from flash_vllm.ple import synth
    from vllm.compilation import breakable_cudagraph as bc

    # breakable graphs on at layer init: the gather is an eager break (0.29 has the mechanism)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    layer = v029.build(None, prefix=V029_PREFIX)
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    emb = layer.ngram_embedding
    assert getattr(emb._flash_gather, "__wrapped__", None) is not None

    ids = torch.full((4, 2), 1 << 40, dtype=torch.long)  # static ids buffer, garbage at capture
    out = torch.full((4, 2, V029_WIDTH), 7, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(IndexError):
        emb.flash_lookup(ids, out)  # outside a capture the engine range-checks the ids
    cap = cpu_capture(monkeypatch)
    with cap:
        emb.flash_lookup(ids, out)
    assert not out.view(torch.uint8).any() and cap.num_eager_breaks == 1
    ids.copy_(torch.tensor([[0, 1], [V029_ROWS - 1, 5], [60, 61], [100, 2]]))
    cap.replay()  # outside the capture: the real rows land in the persistent buffer the graph reads
    want = synth.reference_rows(v029.ckpt, ids.numpy()).reshape(4, 2, V029_WIDTH)
    assert np.array_equal(emb._flash_out[:4].view(torch.uint8).numpy(), want)
    # inside a plain stream capture (FULL graph, or splitting ops without ours): refuse, loudly
    from flash_vllm.patches.p01_ple_mmap import guard as _ple_guard

    monkeypatch.setattr(_ple_guard, "_is_capturing", lambda torch: True)
    with pytest.raises(RuntimeError, match="PIECEWISE"):
        emb.flash_lookup(ids, out)
