"""Patch 1 (PLE from mmap) with the real vLLM storage classes, on CPU.

On the bases it ships code for: `check()` passes on the release's source, `apply()` replaces both
storage classes (and every stale binding) and is idempotent, and the patched class built by
vLLM's own constructor (real fp8 quant method, real ETP/TP groups of size 1 over gloo) has no
table storage (`meta` weight), ignores the shard rows at load time and returns exactly
`table[ids] * scale` of a small synthetic checkpoint read from disk by the PLE engine.
On the other bases: `check()` refuses (the registry says not-ported there).
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


@pytest.fixture(scope="module")
def applied(patch1, base):
    if not patch1.meant_for(base):
        return None
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
    return SimpleNamespace(ng=ng, common=common, stock=stock, first=first)


def test_apply_swaps_storage_classes_idempotently(applied, base, patch1):
    if applied is None:
        assert not patch1.meant_for(base)
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
def layer(applied, checkpoint, tmp_path_factory):
    """The patched pinned-host class built as Qwen4ExpNGramEmbedding builds it (fp8 checkpoint)."""
    if applied is None:
        yield None
        return
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    dist = tmp_path_factory.mktemp("dist") / "init"
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{dist}",
                                        local_rank=0, backend="gloo")
        ps.initialize_model_parallel(1, 1)
        cfg.model_config = SimpleNamespace(model=str(checkpoint))  # what the patch reads: the model path
        try:
            method = applied.common.Qwen4ExpPLEEmbeddingMethod.from_quant_config(None, PREFIX, "float8_e4m3fn")
            emb = applied.ng.Qwen4ExpPLEPinnedHostEmbedding(
                NUM_ROWS, WIDTH, params_dtype=torch.bfloat16, padding_size=4, prefix=PREFIX,
                embedding_method=method, num_ngram_heads=2, max_total_tokens=16)
            yield SimpleNamespace(emb=emb, method=method)
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def _reference(checkpoint, ids):
    from flash_vllm.ple import PLETable

    t = PLETable.from_checkpoint(checkpoint, layer=1)
    raw = torch.from_numpy(t.gather(ids.numpy()).copy()).view(torch.float8_e4m3fn)
    return (raw.float() * t.scale).to(torch.bfloat16).view(*ids.shape, WIDTH)


def test_lookup_returns_table_rows_without_storage(layer, checkpoint, base, patch1):
    if layer is None:
        assert not patch1.meant_for(base)
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
    from flash_vllm.patches import ple_mmap

    total = ple_mmap.TABLES.stats.snapshot()["total"]
    assert total["ops"] >= 4 and total["rows"] >= 1 + 3 * 2 + 16 * 2  # one op per lookup, every row


def test_capture_time_run_zero_fills(layer, checkpoint, base, patch1, monkeypatch):
    """During a breakable capture the eager segment runs once with recorded (garbage) ids: it
    must not read the table (ids may be out of range) and leaves zeros; the recorded segment,
    replayed outside the capture on the same static buffers, gathers the real rows."""
    if layer is None:
        assert not patch1.meant_for(base)
        return
    from vllm.compilation import breakable_cudagraph as bc

    class Capture:  # BreakableCUDAGraphCapture.add_eager's contract: run now, record for replay
        _capturing = True

        def __init__(self):
            self.segments = []

        def add_eager(self, fn):
            result = fn()
            self.segments.append(fn)
            return result

    emb = layer.emb
    ids = torch.full((4, 2), 1 << 40, dtype=torch.long)  # the static ids buffer, garbage at capture
    with pytest.raises(IndexError):
        emb(ids)  # outside a capture the engine range-checks the ids
    cap = Capture()
    monkeypatch.setattr(bc.BreakableCUDAGraphCapture, "current", classmethod(lambda cls: cap))
    monkeypatch.setattr(bc, "_weak_ref_capture_arg", lambda a: a)  # weak refs need vllm._C (CUDA)
    emb._flash_out.fill_(7)
    out = emb(ids)
    assert out.shape == (4, 2, WIDTH) and not out.any()
    # the gather is an eager break exactly when the decorator was active at layer init
    # (VLLM_USE_BREAKABLE_CUDAGRAPH, which VllmConfig sets for Qwen4Exp)
    wrapped = getattr(emb._flash_gather, "__wrapped__", None) is not None
    assert len(cap.segments) == (1 if wrapped else 0)
    if cap.segments:
        monkeypatch.setattr(bc.BreakableCUDAGraphCapture, "current", classmethod(lambda cls: None))
        ids.copy_(torch.tensor([[0, 1], [NUM_ROWS - 1, 5], [60, 61], [100, 2]]))
        cap.segments[0]()  # replay
        assert torch.equal(out.view(torch.int16), _reference(checkpoint, ids).view(torch.int16))
