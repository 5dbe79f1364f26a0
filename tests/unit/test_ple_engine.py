"""PLE config from env, stats line + Prometheus counters (failure-proof), CPU staging."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

from flash_vllm.ple import stats as stats_mod
from flash_vllm.ple.config import GRAPH_MAX_ROWS, PLEConfigError, config_from_env
from flash_vllm.ple.stager import Stager
from flash_vllm.ple.stats import PLEStats
from flash_vllm.ple.synth import reference_rows, write_checkpoint
from flash_vllm.ple.table import PLETable


def test_config_defaults_and_values():
    c = config_from_env({})
    assert (c.enabled, c.workers, c.prewarm, c.madvise, c.fast_rows) == (False, 32, False, "random", 0)
    c = config_from_env({"VLLM_PLE_MMAP": "1", "VLLM_PLE_MMAP_WORKERS": "8", "VLLM_PLE_MMAP_PREWARM": "1",
                         "VLLM_PLE_MMAP_MADVISE": "normal", "VLLM_PLE_MMAP_FAST_ROWS": "512",
                         "VLLM_PLE_MMAP_STATS_SEC": "0", "OTHER": "x"})
    assert (c.enabled, c.workers, c.prewarm, c.madvise, c.fast_rows, c.stats_sec) == (True, 8, True, "normal", 512, 0.0)
    assert config_from_env({"VLLM_PLE_MMAP_MADVISE": "1"}).madvise == "random"


@pytest.mark.parametrize("env, needle", [
    ({"VLLM_PLE_MMAP_WORKERS": "0"}, "VLLM_PLE_MMAP_WORKERS=0 is out of range"),
    ({"VLLM_PLE_MMAP_WORKERS": "lots"}, "not an integer"),
    ({"VLLM_PLE_MMAP_MADVISE": "sequential"}, "not one of random, normal"),
    ({"VLLM_PLE_MMAP_FAST_ROWS": "-1"}, "out of range"),
    ({"VLLM_PLE_MMAP_PREWARM": "2"}, "not a boolean"),
    ({"VLLM_PLE_MMAP_STATS_SEC": "soon"}, "number of seconds"),
    ({"VLLM_PLE_MMAP_WORKRES": "4"}, "unknown PLE setting"),
    ({"VLLM_PLE_MMAP_DEDUP_MIN": "0"}, r"VLLM_PLE_MMAP_DEDUP_MIN=0 is out of range \(accepted: 1\.\.16777216\)"),
    ({"VLLM_PLE_MMAP_DEDUP_MIN": "1k"}, "VLLM_PLE_MMAP_DEDUP_MIN='1k' is not an integer"),
])
def test_config_rejects(env, needle):
    with pytest.raises(PLEConfigError, match=needle):
        config_from_env(env)


class _Clock:
    t = 100.0

    def __call__(self):
        return self.t


def test_stats_line_and_reset(caplog):
    clk = _Clock()
    st = PLEStats(stats_sec=30, prometheus=False, clock=clk)
    st.record(ops=1, op_s=0.004, gpu_wait_s=0.001, dedup_s=0.0005, gather_s=0.002, stage_s=0.0005, rows=48, bytes=7680)
    st.record(ops=1, op_s=0.002, gather_s=0.001, rows=48, bytes=7680, bogus=3)
    assert not st.maybe_log()  # window not over yet
    clk.t += 31
    with caplog.at_level(logging.INFO, logger="vllm.ple_mmap"):
        assert st.maybe_log()
    line = caplog.records[-1].getMessage()
    # The upstream prefix benchmark scripts parse, then the later suffix.
    assert re.match(r"PLE mmap stats \(last 31s\): 2 ops, op 6\.0 ms total \(3\.00 ms/op\), gather 3\.0 ms total "
                    r"\(1\.50 ms/op\), 96 rows, 0\.0 MiB read", line), line
    assert line.endswith("gpu-wait 0.50 ms/op, host 2.50 ms/op (dedup 0.25, gather 1.50, stage 0.25)"), line
    assert st.snapshot()["window"]["ops"] == 0 and st.snapshot()["total"]["ops"] == 2
    clk.t += 31
    assert not st.maybe_log()  # nothing happened: no line


def test_prometheus_counters_real_registry():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    reg = CollectorRegistry()
    st = PLEStats(prometheus=True, registry=reg)
    st.record(ops=2, op_s=0.5, gpu_wait_s=0.1, dedup_s=0.01, gather_s=0.3, stage_s=0.05, rows=96, bytes=15360)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    want = {"vllm:ple_mmap_lookup_ops": 2, "vllm:ple_mmap_op_seconds": 0.5, "vllm:ple_mmap_gpu_wait_seconds": 0.1,
            "vllm:ple_mmap_dedup_seconds": 0.01, "vllm:ple_mmap_gather_seconds": 0.3,
            "vllm:ple_mmap_stage_seconds": 0.05, "vllm:ple_mmap_rows": 96, "vllm:ple_mmap_bytes": 15360}
    for name, v in want.items():
        s = [x for x in fams[name].samples if x.name == name + "_total"]
        assert s and s[0].value == pytest.approx(v), name
    start = fams["vllm:ple_mmap_engine_start_time_seconds"].samples[0].value
    assert start > 1.7e9


def test_metrics_failure_never_breaks_a_lookup(tmp_path, monkeypatch, caplog):
    class Boom:
        def inc(self, v):
            raise RuntimeError("registry gone")

    st = PLEStats(prometheus=False)
    st._prom = {"ops": Boom(), "rows": Boom()}
    st.record(ops=1, rows=5)  # must not raise
    monkeypatch.setattr(stats_mod, "_prom", None)
    monkeypatch.setenv("FLASH_METRICS_BRIDGE", "0")  # the native-counter path (the bridge is tested apart)
    monkeypatch.setattr(stats_mod, "_make", lambda reg: (_ for _ in ()).throw(ValueError("Duplicated timeseries")))
    with caplog.at_level(logging.WARNING, logger="vllm.ple_mmap"):
        st2 = PLEStats(prometheus=True)
    assert st2._prom is None and "Prometheus counters disabled" in caplog.text
    write_checkpoint(tmp_path, rows_per_shard=20, num_shards=2)
    with PLETable.from_checkpoint(tmp_path, stats=st) as t:
        assert t.gather(np.array([1, 2, 39])).shape == (3, 160)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("stage")
    write_checkpoint(d, rows_per_shard=997, num_shards=6, last_rows=5, per_file=4)
    return d


@pytest.mark.parametrize("shape, dedup_min", [((256,), 256), ((20, 16), 256), ((33, 16), 256), ((65, 16), None)])
def test_stager_distinct_ids_keep_their_order(small, shape, dedup_min):
    """A deduplicated batch (>= dedup_min rows) whose ids are all distinct: the unique rows come
    back in sorted-id order and still need the inverse. run38 on the H200: without it every
    in-graph prefill of 16-33 tokens (16 heads) served permuted PLE rows, and greedy output
    differed from stock vLLM from the first token."""
    with PLETable.from_checkpoint(small) as t:
        s = Stager(t, "cpu", dedup_min=dedup_min)  # run38's sizes at its threshold; past the default
        assert shape[0] * (shape[1] if len(shape) > 1 else 1) >= s.dedup_min
        rng = np.random.default_rng(shape[0])
        ids = rng.choice(t.num_rows, int(np.prod(shape)), replace=False).reshape(shape)
        assert not np.all(np.diff(ids.reshape(-1)) > 0)  # not already sorted: order matters
        ref = torch.from_numpy(reference_rows(small, ids)).view(torch.float8_e4m3fn).view(*shape, 160)
        assert torch.equal(s.lookup(ids, raw=True).view(torch.uint8), ref.view(torch.uint8))
        out = torch.empty(*shape, 160, dtype=torch.bfloat16)
        assert s.lookup(ids, out=out) is out
        assert torch.equal(out.view(torch.int16), (ref.float() * t.scale).to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("dedup_min, deduplicated", [(None, False), ("256", True), ("384", True), ("385", False)])
def test_stager_dedup_min_comes_from_the_tables_config(small, monkeypatch, dedup_min, deduplicated):
    """VLLM_PLE_MMAP_DEDUP_MIN reaches the Stager through the table's config: a c=8 x MTP=2 decode
    batch (24 tokens x 16 heads = 384 rows) is gathered as it is at the default (just past the
    Stager's graph limit: every batch that can replay a graph does), deduplicated at run6's 256 and
    at 384; the rows are the table's either way."""
    cfg = config_from_env({} if dedup_min is None else {"VLLM_PLE_MMAP_DEDUP_MIN": dedup_min})
    with PLETable.from_checkpoint(small, config=cfg) as t:
        s = Stager(t, "cpu")
        assert s.dedup_min == cfg.dedup_min == (GRAPH_MAX_ROWS + 1 if dedup_min is None else int(dedup_min))
        calls = []
        real = t.gather_unique
        monkeypatch.setattr(t, "gather_unique", lambda *a, **k: calls.append(1) or real(*a, **k))
        ids = np.random.default_rng(8).integers(0, t.num_rows, (24, 16))
        ref = torch.from_numpy(reference_rows(small, ids)).view(torch.uint8).view(24, 16, 160)
        assert torch.equal(s.lookup(ids, raw=True).view(torch.uint8), ref)
        assert bool(calls) is deduplicated
    assert Stager(t, "cpu", dedup_min=7).dedup_min == 7  # an explicit value wins


@pytest.mark.parametrize("shape", [(3,), (48,), (12, 16), (700, 16)])
def test_stager_cpu_bit_exact(small, shape):
    st = PLEStats(stats_sec=0, prometheus=False)
    with PLETable.from_checkpoint(small, stats=st) as t:
        s = Stager(t, "cpu", stats=st, max_rows=16)  # small: forces regrowth
        rng = np.random.default_rng(shape[0])
        for _ in range(3):  # reuses both slots
            ids = rng.integers(0, t.num_rows, shape)
            ids.reshape(-1)[: ids.size // 3] = ids.reshape(-1)[-(ids.size // 3):]
            ids.reshape(-1)[0] = t.num_rows - 1
            ref = torch.from_numpy(reference_rows(small, ids)).view(torch.float8_e4m3fn)
            want = (ref.float() * t.scale).to(torch.bfloat16).view(*shape, 160)
            got = s.lookup(ids)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            raw = s.lookup(torch.from_numpy(ids), raw=True)
            assert torch.equal(raw.view(torch.uint8), ref.view(torch.uint8).view(*shape, 160))
            out = torch.empty(*shape, 160, dtype=torch.float16)
            s.out_dtype = torch.float16
            assert s.lookup(ids, out=out) is out
            assert torch.equal(out.view(torch.int16), (ref.float() * t.scale).to(torch.float16).view(*shape, 160).view(torch.int16))
            s.out_dtype = torch.bfloat16
        snap = st.snapshot()["total"]
        assert snap["ops"] == 9 and snap["rows"] > 0 and snap["stage_s"] > 0 and snap["gather_s"] > 0
        with pytest.raises(IndexError):
            s.lookup(np.array([t.num_rows]))
