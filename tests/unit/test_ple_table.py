"""PLE table: shard map from the index, every gather strategy bit-identical to table[ids]."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flash_vllm.ple.config import PLEConfig
from flash_vllm.ple.synth import write_checkpoint, reference_rows
from flash_vllm.ple.table import PLETable, PLETableError
from ple_io import skip_unless_available

RPS, NSH, LAST = 997, 20, 311  # partial last shard


@pytest.fixture(scope="module", params=["radixark", "nvidia"])
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    write_checkpoint(d, layout=request.param, rows_per_shard=RPS, num_shards=NSH, last_rows=LAST, per_file=3,
                     buffers={"layer_multipliers": [3, 5, 7]})
    return d


def _ids(rng, n, num_rows):
    ids = rng.integers(0, num_rows, n)
    ids[: n // 3] = ids[n // 3 : 2 * (n // 3)]  # duplicates
    # shard boundaries, the first and the last row of the partial shard
    edge = [0, RPS - 1, RPS, 2 * RPS - 1, (NSH - 1) * RPS - 1, (NSH - 1) * RPS, num_rows - 1]
    ids[-len(edge):] = edge[: min(len(edge), n)] if n >= len(edge) else ids[-len(edge):]
    return ids


def test_shard_map(ckpt):
    with PLETable.from_checkpoint(ckpt) as t:
        assert t.num_rows == RPS * (NSH - 1) + LAST
        assert (t.dtype, t.head_dim, t.row_bytes, t.rows_per_shard) == ("F8_E4M3", 160, 160, RPS)
        assert t.scale == 0.03125
        assert t.buffers["layer_multipliers"].tolist() == [3, 5, 7]
        assert t.prefix.endswith("layers.1.ple.ple_embedding.ngram_embedding.")


@pytest.mark.parametrize("io", ["uring", "mmap", "auto"])
@pytest.mark.parametrize("n", [1, 7, 48, 192, 5000, 20000])
def test_gather_bit_identical(ckpt, io, n):
    cfg = PLEConfig(io=io, workers=4, chunk=512)
    if io == "auto":
        cfg = PLEConfig(workers=4, chunk=512)
    skip_unless_available(io, ckpt)  # only io=uring, only when the probe finds no io_uring
    t = PLETable.from_checkpoint(ckpt, config=cfg)
    rng = np.random.default_rng(n)
    strategies = set()
    with t:
        for _ in range(4):  # cold-ish, then warm (uring -> take switch)
            ids = _ids(rng, n, t.num_rows)
            assert np.array_equal(t.gather(ids), reference_rows(ckpt, ids))
            strategies.add(t.last_strategy)
            u, inv = t.gather_unique(ids.reshape(1, -1))
            assert np.array_equal(u[inv], reference_rows(ckpt, ids))
            assert np.all(np.diff(np.unique(ids)) > 0) and u.shape[0] == np.unique(ids).shape[0]
        t.drop_cache()
        ids = _ids(rng, n, t.num_rows)
        out = np.empty((n, 160), np.uint8)
        assert t.gather(ids, out=out) is out and np.array_equal(out, reference_rows(ckpt, ids))
    expected = {"uring": {"uring", "take"}, "mmap": {"willneed", "pool", "take"},
                "auto": {"uring", "take", "willneed", "pool", "direct"}}[io]
    assert strategies <= expected and strategies


def test_fast_rows_forces_take(ckpt):
    with PLETable.from_checkpoint(ckpt, config=PLEConfig(fast_rows=64)) as t:
        ids = np.arange(0, t.num_rows, 400)[:64]
        assert np.array_equal(t.gather(ids), reference_rows(ckpt, ids))
        assert t.last_strategy == "take"


@pytest.mark.parametrize("n", [1, 8, 5000])
def test_out_of_range_raises_index_error(ckpt, n):
    with PLETable.from_checkpoint(ckpt) as t:
        for bad in (t.num_rows, t.num_rows + 10**9, -1):
            ids = np.zeros(n, np.int64)
            ids[-1] = bad
            with pytest.raises(IndexError, match=str(bad)):
                t.gather(ids)
            with pytest.raises(IndexError):
                t.gather_unique(ids)
        with pytest.raises(TypeError):
            t.gather(np.array([1.5]))
        assert t.gather(np.array([], np.int64)).shape == (0, 160)


def test_bf16_table_and_f32_scale(tmp_path):
    write_checkpoint(tmp_path, rows_per_shard=50, num_shards=3, dtype="BF16", width=8, scale=None)
    with PLETable.from_checkpoint(tmp_path) as t:
        assert (t.dtype, t.row_bytes, t.scale) == ("BF16", 16, None)
        ids = np.array([0, 49, 50, 149, 3])
        assert np.array_equal(t.gather(ids), reference_rows(tmp_path, ids))


def test_scale_dtypes(tmp_path):
    for i, sd in enumerate(("F32", "F16", "BF16")):
        d = tmp_path / sd
        write_checkpoint(d, rows_per_shard=10, num_shards=2, scale=0.375, scale_dtype=sd, seed=i)
        with PLETable.from_checkpoint(d) as t:
            assert t.scale == 0.375


def _edit_index(d, fn):
    p = d / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    fn(idx["weight_map"])
    p.write_text(json.dumps(idx))


@pytest.mark.parametrize(
    "kw, edit, needle",
    [
        ({}, lambda w: w.pop("model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight"), "missing shard"),
        ({"scale": None}, None, "without"),
        ({"dtype": "F32", "scale": None, "width": 4}, None, None),  # F32 accepted
        ({}, lambda w: w.update({"model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight":
                                 "model-plefp8-00001.safetensors"}), "does not hold it"),
        ({}, lambda w: [w.pop(k) for k in list(w) if "shard_" in k], "no '…ple"),
    ],
)
def test_bad_checkpoints(tmp_path, kw, edit, needle):
    args = dict(rows_per_shard=10, num_shards=4, per_file=2)
    args.update(kw)
    write_checkpoint(tmp_path, **args)
    if edit:
        _edit_index(tmp_path, edit)
    if needle is None:
        PLETable.from_checkpoint(tmp_path).close()
        return
    with pytest.raises(PLETableError, match=needle):
        PLETable.from_checkpoint(tmp_path)


def test_uneven_middle_shard_rejected(tmp_path):
    from flash_vllm.ple.table import ShardSpec

    write_checkpoint(tmp_path, rows_per_shard=10, num_shards=2)
    f = str(tmp_path / "model-plefp8-00000.safetensors")
    with pytest.raises(PLETableError, match="every shard but the last"):
        PLETable([ShardSpec(0, f, 100, 9), ShardSpec(1, f, 2000, 10)], "F8_E4M3", 160)
    with pytest.raises(PLETableError, match="config implies"):
        PLETable.from_checkpoint(tmp_path, expected_rows=21)


def test_truncated_file_is_a_header_error(tmp_path):
    write_checkpoint(tmp_path, rows_per_shard=10, num_shards=2)
    f = tmp_path / "model-plefp8-00000.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(PLETableError, match="truncated"):
        PLETable.from_checkpoint(tmp_path)


def test_prefetch_and_prewarm(ckpt):
    with PLETable.from_checkpoint(ckpt, config=PLEConfig(prewarm=True)) as t:
        t.prefetch(np.array([0, 5, t.num_rows - 1]))
        with pytest.raises(IndexError):
            t.prefetch(np.array([t.num_rows]))
        assert "PLE mmap:" in t.describe()


def test_cold_path_choice_and_warm_switch(ckpt):
    """auto keeps the faster timed cold path (retrying the other every 16th cold batch); a batch
    that read nothing from disk switches to the mapping, and a drop of the cache switches back."""
    skip_unless_available("uring", ckpt)
    t = PLETable.from_checkpoint(ckpt)
    with t:
        assert t.io == "uring", t.io_note  # the probe says io_uring works: auto must use it
        t._ewma[0] = {"uring": 2e-6, "mmap": 1e-6}
        t._cold_n[0] = 0
        picks = [t._pick(0) for _ in range(32)]
        assert picks.count("uring") == 2 and picks[15] == picks[31] == "uring"
        assert set(picks) == {"uring", "mmap"}
        for _ in range(5):  # the ring got faster: the choice follows
            t._learn(0, "uring", 0.0)
        assert t._ewma[0]["uring"] < t._ewma[0]["mmap"] and t._pick(0) == "uring"
        ids = np.arange(0, t.num_rows, 97)[:48]
        t.drop_cache()
        t.gather(ids)
        t.gather(ids)  # now cached: nothing read from disk
        t.gather(ids)
        assert t.last_strategy == "take"
        t.drop_cache()
        assert t._warm == 0
        assert np.array_equal(t.gather(ids), reference_rows(ckpt, ids)) and t.last_strategy != "take"
