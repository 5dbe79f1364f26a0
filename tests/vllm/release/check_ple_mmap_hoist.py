"""Patch 1's hoisted mode (VLLM_PLE_MMAP_MODE=hoisted) with the real vLLM classes, on CPU.

Named to sort after check_ple_mmap.py: that file records the stock classes before it applies patch 1.

On the bases the mode serves (`ple_hoist.BASES`, 0.30-0.33):
- `check()` finds the runner's call sites, `apply()` wraps `Qwen4ExpModelState.prepare_inputs`
  (the class the model hands the V2 runner) idempotently and `verify()` passes;
- the real `Qwen4ExpModelState.prepare_inputs` (ngram_context from the request states, padded
  query_start_loc) runs with the hook, on random token streams: decode steps, MTP draft positions,
  prefill chunks, EOS inside, padded tokens and padded requests, a non-identity idx_mapping;
- the rows the hook stages, read by the real `Qwen4ExpNGramEmbedding.forward`, are bit-identical
  to what the eager path gathers for the same step, and to `table[ids] * scale` for ids from
  flash's independent hashing (`flash_vllm.ple.hashing`) of the request's tokens;
- dummy batches are not gathered; a forward whose token count differs from what was staged
  raises; with VLLM_PLE_MMAP_HOIST_CHECK the forward's ids are compared with the staged ones.

Elsewhere the mode is not served: patch 1 stays eager there.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

NGRAM = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
STATE = "vllm.models.qwen4_exp.nvidia.model_state"
PREFIX = "model.language_model.layers.1.ple.ple_embedding"
VOCAB, EOS, HPN, NGRAM_SIZE, BASE_SIZE, DIV = 64, 7, 2, 3, 40, 4
HEADS = (NGRAM_SIZE - 1) * HPN
WIDTH = 32
ROWS, LAST, SHARDS = 50, 40, 4  # 190 rows >= 184 (41 + 43 + 47 + 53)
MAX_TOKENS, MAX_REQS, MAX_LEN = 64, 8, 256
CFG = SimpleNamespace(ngram_size=NGRAM_SIZE, heads_per_ngram=HPN, eos_token_id=EOS, vocab_size=VOCAB,
                      split_ngram_parts=SHARDS, seed=1234, ngram_vocab_size_base=BASE_SIZE,
                      make_ngram_vocab_size_divisible_by=DIV, ple_embedding_dtype="float8_e4m3fn",
                      ple_embed_dim=HEADS * WIDTH)
ENV = {"VLLM_PLE_MMAP": "1", "VLLM_PLE_MMAP_MODE": "hoisted"}


def _ctx(env=ENV):
    from flash_vllm import compat
    from flash_vllm.registry import Context

    return Context(compat.resolve(compat.installed_vllm_version(), {}), dict(env))


@pytest.fixture(scope="module")
def hoist():
    from flash_vllm.patches.p01_ple_mmap import hoist as ple_hoist

    return ple_hoist


@pytest.fixture(scope="module")
def patch1():
    from flash_vllm.registry import by_number

    return by_number(1)


@pytest.fixture(scope="module")
def served(hoist, base):
    return hoist.serves(base)


@pytest.fixture(scope="module")
def applied(patch1, hoist, base, served):
    """Patch 1 applied with the hoisted mode; the module flag is restored afterwards so later
    check files build eager storages."""
    was = hoist.ACTIVE, hoist.CHECK
    ctx = _ctx()
    try:
        if served:
            patch1.check(ctx)
        patch1.apply(ctx)
        patch1.apply(ctx)
        patch1.verify(ctx)
        yield SimpleNamespace(active=hoist.ACTIVE)
    finally:
        hoist.ACTIVE, hoist.CHECK = was


def test_mode_served_where_registered(applied, hoist, base, served):
    assert served == (base in hoist.BASES)
    assert applied.active == served  # elsewhere: stays eager (preflight refuses the combination)
    if not served:
        assert base in hoist.NOT_PORTED
        return
    st = importlib.import_module(STATE)
    prep = st.Qwen4ExpModelState.__dict__["prepare_inputs"]
    assert prep.__flash_patch__ == 1
    assert prep.__flash_original__.__qualname__ == "Qwen4ExpModelState.prepare_inputs"
    # the class the model hands the V2 runner is the one we wrapped
    model = importlib.import_module("vllm.models.qwen4_exp.nvidia.model")
    assert model.Qwen4ExpForConditionalGeneration.get_model_state_cls() is st.Qwen4ExpModelState


def test_bad_mode_names_the_accepted_values(hoist):
    with pytest.raises(ValueError, match="eager, hoisted"):
        hoist.mode_of({"VLLM_PLE_MMAP_MODE": "full"})
    assert hoist.mode_of({}) == "eager"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from flash_vllm.ple import synth

    d = tmp_path_factory.mktemp("ple-hoist-ckpt")
    synth.write_checkpoint(d, layout="nvidia", rows_per_shard=ROWS, num_shards=SHARDS, last_rows=LAST,
                           width=WIDTH)
    return d


@pytest.fixture(scope="module")
def rig(applied, served, hoist, checkpoint, tmp_path_factory, cpu_world):
    """An eager and a hoisted `Qwen4ExpNGramEmbedding` (the release's class, patched storage) and a
    real `Qwen4ExpModelState` whose model holds the hoisted one."""
    if not served:
        yield None
        return
    ng = importlib.import_module(NGRAM)
    st = importlib.import_module(STATE)
    with cpu_world(tmp_path_factory, checkpoint):
        try:
            mods = {}
            for mode in ("eager", "hoisted"):
                hoist.ACTIVE = mode == "hoisted"
                mods[mode] = ng.Qwen4ExpNGramEmbedding(CFG, HEADS * WIDTH, 0, MAX_TOKENS, data_parallel_rank=0,
                                                       prefix=PREFIX, params_dtype=torch.bfloat16)
            hoist.ACTIVE = True
            assert mods["eager"].ngram_embedding._flash_hoist is None
            hoisted = mods["hoisted"].ngram_embedding
            assert hoisted._flash_hoist is not None and hoisted._flash_stager is None
            # the profile run's dummy forward (no hook staging): opens the table, gathers nothing
            dummy_ids = torch.zeros(4, HEADS, dtype=torch.long)
            assert not hoisted(dummy_ids).any()  # the zeroed buffer
            assert hoisted._flash_stager is not None and hoisted._flash_hoist.steps == 0
            state = object.__new__(st.Qwen4ExpModelState)  # the real class; its __init__ needs a runner
            state.__dict__.update(
                model=torch.nn.ModuleDict({"ple": mods["hoisted"]}), rope_state=None,
                uses_ngram_embedding=True, ngram_context_len=NGRAM_SIZE - 1, ngram_eos_token_id=EOS,
                ngram_context=torch.full((MAX_REQS, NGRAM_SIZE - 1), EOS, dtype=torch.int32),
                ngram_context_offsets=torch.arange(-(NGRAM_SIZE - 1), 0, dtype=torch.int64),
                ple_query_start_loc=torch.zeros(MAX_REQS + 1, dtype=torch.int32))
            yield SimpleNamespace(eager=mods["eager"], hoisted=mods["hoisted"], state=state)
        finally:
            hoist.ACTIVE = applied.active


class Stream:
    """Requests with committed token histories, stepped like the V2 runner feeds the model."""

    def __init__(self, rng, n_reqs):
        self.rng = rng
        self.ids = [f"r{i}" for i in range(n_reqs)]
        self.slot = {r: int(s) for r, s in zip(self.ids, rng.permutation(MAX_REQS)[:n_reqs])}
        self.hist = {r: [] for r in self.ids}
        self.all_token_ids = torch.zeros(MAX_REQS, MAX_LEN, dtype=torch.int32)
        self.num_computed = torch.zeros(MAX_REQS, dtype=torch.int32)

    def tokens(self, n, p_eos):
        t = self.rng.integers(0, VOCAB, size=n)
        t[self.rng.random(n) < p_eos] = EOS
        return t.astype(np.int64)

    def step(self, queries, pad_tokens=0, pad_reqs=0, dummy=False):
        """queries: {req_id: query tokens}. Returns (input_batch, req_states)."""
        reqs = list(queries)
        lens = [len(queries[r]) for r in reqs]
        n = sum(lens)
        qsl = np.zeros(len(reqs) + pad_reqs + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:len(reqs) + 1])
        qsl[len(reqs) + 1:] = n  # the runner pads requests with empty ones
        ids = np.concatenate([queries[r] for r in reqs] + [self.tokens(pad_tokens, 0.0)]).astype(np.int32)
        for r in reqs:
            s, h = self.slot[r], self.hist[r]
            self.num_computed[s] = len(h)
            if h:
                self.all_token_ids[s, :len(h)] = torch.tensor(h, dtype=torch.int32)
        known = {} if dummy else {r: self.slot[r] for r in self.ids}
        batch = SimpleNamespace(
            req_ids=[f"req_{i}_dummy" for i in range(len(reqs))] if dummy else reqs,
            num_reqs=len(reqs), num_reqs_after_padding=len(reqs) + pad_reqs,
            idx_mapping=torch.tensor([self.slot[r] for r in reqs], dtype=torch.int64),
            query_start_loc=torch.from_numpy(qsl), input_ids=torch.from_numpy(ids))
        req_states = SimpleNamespace(req_id_to_index=known,
                                     num_computed_tokens=SimpleNamespace(gpu=self.num_computed),
                                     all_token_ids=SimpleNamespace(gpu=self.all_token_ids))
        return batch, req_states

    def commit(self, queries, accept):
        for r, toks in queries.items():
            self.hist[r].extend(int(t) for t in toks[:accept.get(r, len(toks))])


def _forward(mod, batch, inputs):
    n = batch.input_ids.shape[0]
    hidden = torch.zeros(n, HEADS * WIDTH, dtype=torch.bfloat16)
    return mod(hidden, batch.input_ids, inputs["query_start_loc"], inputs["ngram_context"])


def _reference(checkpoint, stream, queries):
    """table[ids] * scale for ids from flash's own hashing of each request's history + query."""
    from flash_vllm.ple import PLETable
    from flash_vllm.ple.hashing import PLELayout, ngram_ids

    layout = PLELayout.from_config(CFG)
    t = PLETable.from_checkpoint(checkpoint, layer=1)
    out = []
    for r, toks in queries.items():
        h = stream.hist[r]
        ctx = ([EOS] * (NGRAM_SIZE - 1) + h)[-(NGRAM_SIZE - 1):]
        ids = ngram_ids(toks, layout, context=ctx)
        raw = torch.from_numpy(t.gather(ids).copy()).view(torch.float8_e4m3fn)
        out.append((raw.float() * t.scale).to(torch.bfloat16).reshape(len(toks), HEADS * WIDTH))
    return torch.cat(out)


def _bits(x):
    return x.contiguous().view(torch.int16)


def _schedule(rng, stream, kind):
    """One step's queries: decode (1 token), MTP verify (1 + 2 drafts), or a prefill chunk mix."""
    live = list(stream.ids)
    if kind == "prefill":
        q = {live[0]: stream.tokens(int(rng.integers(5, 13)), 0.15)}
        q.update({r: stream.tokens(1, 0.2) for r in live[1:]})
    elif kind == "mtp":
        q = {r: stream.tokens(3, 0.25) for r in live}
    else:
        q = {r: stream.tokens(1, 0.25) for r in live}
    return q


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hoisted_rows_equal_eager_rows(rig, checkpoint, served, seed):
    if rig is None:
        assert not served
        return
    rng = np.random.default_rng(seed)
    stream = Stream(rng, n_reqs=int(rng.integers(1, 5)))
    slot = rig.hoisted.ngram_embedding._flash_hoist
    steps0 = slot.steps
    # the prompt as prefill chunks (request 0 first, alone), then random decode/MTP/prefill steps
    kinds = ["prefill", "prefill"] + list(rng.choice(["decode", "mtp", "prefill"], size=14))
    checked = 0
    for i, kind in enumerate(kinds):
        q = _schedule(rng, stream, kind)
        pad_t, pad_r = (int(rng.integers(0, 4)), int(rng.integers(0, 2))) if kind != "prefill" else (0, 0)
        batch, rs = stream.step(q, pad_tokens=pad_t, pad_reqs=pad_r)
        inputs = rig.state.prepare_inputs(batch, rs)  # the real method + our hook: rows staged here
        hoisted = _forward(rig.hoisted, batch, inputs).clone()
        eager = _forward(rig.eager, batch, inputs).clone()
        assert torch.equal(_bits(hoisted), _bits(eager)), f"step {i} ({kind}) differs from the eager path"
        n_real = int(batch.query_start_loc[batch.num_reqs])
        want = _reference(checkpoint, stream, q)
        assert torch.equal(_bits(hoisted[:n_real]), _bits(want)), f"step {i} ({kind}) differs from the table"
        checked += n_real
        # MTP: accept a random prefix of the drafts (the rest is rejected, as the sampler would)
        stream.commit(q, {r: int(rng.integers(1, len(t) + 1)) for r, t in q.items()} if kind == "mtp" else {})
    assert slot.steps - steps0 == len(kinds)  # one staging per step
    assert checked >= len(kinds)


def test_dummy_batches_are_not_gathered(rig, served):
    if rig is None:
        assert not served
        return
    rng = np.random.default_rng(5)
    stream = Stream(rng, n_reqs=2)
    q = {r: stream.tokens(1, 0.0) for r in stream.ids}
    batch, rs = stream.step(q, dummy=True)
    emb = rig.hoisted.ngram_embedding
    slot = emb._flash_hoist
    d0, s0 = slot.dummies, slot.steps
    emb._flash_out.fill_(3.0)
    inputs = rig.state.prepare_inputs(batch, rs)
    out = _forward(rig.hoisted, batch, inputs)
    assert slot.dummies == d0 + 1 and slot.steps == s0
    assert bool((out == 3.0).all())  # nothing gathered: the forward only read the buffer


def test_forward_refuses_rows_staged_for_another_step(rig, served, hoist, monkeypatch):
    if rig is None:
        assert not served
        return
    rng = np.random.default_rng(7)
    stream = Stream(rng, n_reqs=2)
    stream.commit({r: stream.tokens(4, 0.0) for r in stream.ids}, {})
    q = {r: stream.tokens(2, 0.0) for r in stream.ids}
    batch, rs = stream.step(q)
    inputs = rig.state.prepare_inputs(batch, rs)
    # a forward over a different token count than staged: refused (host integers, no sync)
    short = SimpleNamespace(input_ids=batch.input_ids[:3])
    with pytest.raises(RuntimeError, match="staged 4"):
        _forward(rig.hoisted, short, inputs)
    # the debug check compares the ids themselves
    monkeypatch.setattr(hoist, "CHECK", True)
    inputs = rig.state.prepare_inputs(batch, rs)
    _forward(rig.hoisted, batch, inputs)  # same ids: passes
    batch.input_ids[1] = (int(batch.input_ids[1]) + 1) % VOCAB
    with pytest.raises(RuntimeError, match="differ"):
        _forward(rig.hoisted, batch, inputs)


def test_capture_warmup_after_a_staged_step_is_a_dummy(rig, served):
    """CUDA-graph capture builds its inputs with the model state's prepare_dummy_inputs (not
    prepare_inputs) and runs one eager warm-up forward on them. Staged rows of an earlier step must
    not be checked against it (H200, real-shape boot of 0.33: "the forward reads 32 PLE rows but the
    runner's hook staged 1 for this step")."""
    if rig is None:
        assert not served
        return
    rng = np.random.default_rng(11)
    stream = Stream(rng, n_reqs=1)
    q = {r: stream.tokens(1, 0.0) for r in stream.ids}
    batch, rs = stream.step(q)
    rig.state.prepare_inputs(batch, rs)  # a real one-token step staged (the engine's warm-up request)
    slot = rig.hoisted.ngram_embedding._flash_hoist
    assert slot.staged_n == 1
    rig.state.__dict__.setdefault("supports_mm_inputs", False)
    rig.state.__dict__.setdefault("prompt_embeds_state", None)
    d0 = slot.dummies
    num_reqs, num_tokens = 8, 32
    inputs = rig.state.prepare_dummy_inputs(num_reqs, num_tokens)  # the real method + our hook
    assert slot.dummies == d0 + 1 and slot.staged_n is None
    ids = torch.zeros(num_tokens, dtype=torch.int32)
    out = _forward(rig.hoisted, SimpleNamespace(input_ids=ids), inputs)  # was: RuntimeError "staged 1"
    assert out.shape[0] == num_tokens


def test_the_steps_wait_for_the_ids_is_counted(rig, served):
    """The hoisted step copies all layers' ids to the host once (the one wait for the previous
    step's GPU work); its fills get host ids and wait for nothing, so the step's wait is recorded
    by the hook, into the same gpu-wait / op counters as the eager mode's per-lookup waits. A dummy
    step copies nothing and records nothing."""
    if rig is None:
        assert not served
        return
    stats = rig.hoisted.ngram_embedding._flash_stager.stats
    assert stats is not None
    rng = np.random.default_rng(13)
    stream = Stream(rng, n_reqs=2)
    q = {r: stream.tokens(2, 0.0) for r in stream.ids}
    before = stats.snapshot()["total"]
    batch, rs = stream.step(q)
    rig.state.prepare_inputs(batch, rs)
    after = stats.snapshot()["total"]
    assert after["ops"] == before["ops"] + 1  # one PLE layer, one lookup
    assert after["gpu_wait_s"] > before["gpu_wait_s"]  # was: unchanged (the fills' own wait is 0)
    assert after["op_s"] - before["op_s"] >= after["gpu_wait_s"] - before["gpu_wait_s"]
    batch, rs = stream.step(q, dummy=True)
    rig.state.prepare_inputs(batch, rs)
    assert stats.snapshot()["total"] == after
