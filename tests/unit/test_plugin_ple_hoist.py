"""Patch 1's hoisted mode, its pure parts (no vLLM): the mode value, the bases it is served on,
and the runtime (Hoister + Slot) on CPU torch with flash's own hashing standing in for the
release's `compute_ngram_ids` (the vllm tier drives the real classes)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flash_vllm.patches.p01_ple_mmap import hoist as ple_hoist  # noqa: E402
from flash_vllm.patches import p01_ple_mmap as ple_mmap  # noqa: E402
from flash_vllm.ple import PLETable, Stager  # noqa: E402
from flash_vllm.ple.hashing import PLELayout, ngram_ids, ngram_ids_batch  # noqa: E402
from flash_vllm.ple.synth import write_checkpoint  # noqa: E402

CFG = dict(vocab_size=500, eos_token_id=7, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
           make_ngram_vocab_size_divisible_by=4, split_ngram_parts=4, ple_embed_dim=64)
LAYOUT = PLELayout.from_config(CFG)


def test_mode_and_bases():
    assert ple_hoist.mode_of({}) == "eager" and ple_hoist.mode_of({"VLLM_PLE_MMAP_MODE": " Hoisted "}) == "hoisted"
    with pytest.raises(ValueError, match="VLLM_PLE_MMAP_MODE='full' is not one of eager, hoisted"):
        ple_hoist.mode_of({"VLLM_PLE_MMAP_MODE": "full"})
    assert ple_hoist.serves("v0.33") and ple_hoist.serves("v0.30") and not ple_hoist.serves("v0.29")
    from flash_vllm import compat

    # every base is either served or says why not (one place: BASES / NOT_PORTED)
    assert set(compat.ORDER) == set(ple_hoist.BASES) | set(ple_hoist.NOT_PORTED)
    assert not set(ple_hoist.BASES) & set(ple_hoist.NOT_PORTED)
    assert all(f"{m}:{q}" in ple_mmap.PATCH.targets for m, q in ple_hoist.TARGETS)


def test_engine_config_knows_the_mode():
    from flash_vllm.ple import config_from_env
    from flash_vllm.ple.config import PLEConfigError

    assert config_from_env({"VLLM_PLE_MMAP_MODE": "hoisted", "VLLM_PLE_MMAP_HOIST_CHECK": "1"}).hoist_check
    with pytest.raises(PLEConfigError, match="VLLM_PLE_MMAP_MODE"):
        config_from_env({"VLLM_PLE_MMAP_MODE": "later"})


class Storage:
    def __init__(self, stager):
        self.stager, self._flash_out, self._flash_rows = stager, None, 32
        self._flash_out_dtype, self.embedding_dim = torch.bfloat16, LAYOUT.head_dim
        self._flash_hoist = ple_hoist.Slot()
        self.gathers = 0

    def _flash_buffer(self, n, heads_shape, device):
        if self._flash_out is None or self._flash_out.shape[0] < n:
            self._flash_out = torch.zeros(max(self._flash_rows, n), *heads_shape, self.embedding_dim,
                                          dtype=self._flash_out_dtype, device=device)
        return self._flash_out

    def _gather_into(self, ids, out):
        self.gathers += 1
        ple_mmap.gather_into(lambda device: self.stager, ids, out)


class NGram(torch.nn.Module):
    def __init__(self, stager):
        super().__init__()
        self.ngram_embedding = Storage(stager)

    def compute_ngram_ids(self, input_ids, query_start_loc, ngram_context, output=None):
        r = int((query_start_loc[1:] > query_start_loc[:-1]).sum())
        return torch.from_numpy(ngram_ids_batch(input_ids.numpy(), query_start_loc[:r + 1].numpy(), LAYOUT,
                                                ngram_context[:r].numpy()))


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    d = tmp_path_factory.mktemp("hoist")
    rps = -(-LAYOUT.num_rows // 4)
    write_checkpoint(d, rows_per_shard=rps, num_shards=4, last_rows=LAYOUT.num_rows - 3 * rps, width=LAYOUT.head_dim)
    t = PLETable.from_checkpoint(d, layer=1)
    mods = [NGram(Stager(t, "cpu")), NGram(Stager(t, "cpu"))]  # two PLE layers: one copy, one wait
    model = torch.nn.ModuleDict({"a": mods[0], "x": torch.nn.Linear(2, 2), "b": mods[1]})
    return SimpleNamespace(t=t, mods=mods, hoister=ple_hoist.Hoister(model))


def _step(rng, reqs=3, q=2):
    toks = rng.integers(0, CFG["vocab_size"], size=(reqs, q))
    toks[rng.random((reqs, q)) < 0.2] = CFG["eos_token_id"]
    ctx = rng.integers(0, CFG["vocab_size"], size=(reqs, 2))
    qsl = torch.arange(0, reqs * q + 1, q, dtype=torch.int32)
    return toks, ctx, qsl


def test_hook_stages_the_rows_of_every_layer(rig):
    assert rig.hoister.layers == rig.mods  # found once, in module order; the Linear is not one
    rng = np.random.default_rng(0)
    for _ in range(4):
        toks, ctx, qsl = _step(rng)
        batch = SimpleNamespace(req_ids=["a", "b", "c"], input_ids=torch.from_numpy(toks.reshape(-1)))
        rig.hoister.stage(batch, SimpleNamespace(req_id_to_index={"a": 0, "b": 1, "c": 2}),
                          {"query_start_loc": qsl, "ngram_context": torch.from_numpy(ctx)})
        want_ids = np.concatenate([ngram_ids(toks[r], LAYOUT, context=ctx[r]) for r in range(3)])
        raw = torch.from_numpy(rig.t.gather(want_ids).copy()).view(torch.float8_e4m3fn)
        want = (raw.float() * rig.t.scale).to(torch.bfloat16)
        for m in rig.mods:
            emb = m.ngram_embedding
            got = emb._flash_hoist.read(emb, torch.from_numpy(want_ids))
            assert torch.equal(got.reshape(want.shape).view(torch.int16), want.view(torch.int16))


def test_dummy_batch_is_skipped_and_a_wrong_count_refused(rig):
    rng = np.random.default_rng(1)
    toks, ctx, qsl = _step(rng)
    inputs = {"query_start_loc": qsl, "ngram_context": torch.from_numpy(ctx)}
    emb = rig.mods[0].ngram_embedding
    g0 = emb.gathers
    rig.hoister.stage(SimpleNamespace(req_ids=["req_0_x", "a", "b"], input_ids=torch.from_numpy(toks.reshape(-1))),
                      SimpleNamespace(req_id_to_index={"a": 0, "b": 1}), inputs)
    assert emb.gathers == g0 and emb._flash_hoist.staged_n is None
    emb._flash_hoist.read(emb, torch.zeros(6, 4, dtype=torch.long))  # no check after a dummy step
    rig.hoister.stage(SimpleNamespace(req_ids=["a"], input_ids=torch.from_numpy(toks.reshape(-1))),
                      SimpleNamespace(req_id_to_index={"a": 0}), inputs)
    assert emb.gathers == g0 + 1
    with pytest.raises(RuntimeError, match="reads 5 PLE rows but the runner's hook staged 6"):
        emb._flash_hoist.read(emb, torch.zeros(5, 4, dtype=torch.long))


def test_debug_check_compares_the_ids(rig, monkeypatch):
    monkeypatch.setattr(ple_hoist, "CHECK", True)
    rng = np.random.default_rng(2)
    toks, ctx, qsl = _step(rng)
    rig.hoister.stage(SimpleNamespace(req_ids=["a"], input_ids=torch.from_numpy(toks.reshape(-1))),
                      SimpleNamespace(req_id_to_index={"a": 0}),
                      {"query_start_loc": qsl, "ngram_context": torch.from_numpy(ctx)})
    emb = rig.mods[1].ngram_embedding
    ids = emb._flash_hoist.staged_ids.clone()
    emb._flash_hoist.read(emb, ids)
    ids[0, 0] += 1
    with pytest.raises(RuntimeError, match="differ from the ids the runner's hook gathered for"):
        emb._flash_hoist.read(emb, ids)


def test_slot_for_new_storage_follows_apply(monkeypatch):
    monkeypatch.setattr(ple_hoist, "ACTIVE", False)
    assert ple_hoist.slot_for_new_storage() is None
    monkeypatch.setattr(ple_hoist, "ACTIVE", True)
    assert isinstance(ple_hoist.slot_for_new_storage(), ple_hoist.Slot)
