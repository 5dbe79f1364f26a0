"""The NVFP4 PLE codec on a real GPU: the Stager's CUDA paths (captured graphs with and without the
zero-copy read of the pinned slot, the eager deduplicated path, a persistent `out`) decode exactly
what the CPU decode gives (tests/unit/test_ple_nvfp4.py holds that to a numpy reference), NaN block
scales included.

Run where a GPU exists: `tests/run gpu` (or `python -m pytest -m gpu tests/gpu`).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flash_vllm.ple import open_table, synth  # noqa: E402
from flash_vllm.ple.nvfp4 import Decoder  # noqa: E402
from flash_vllm.ple.stager import Stager  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu tier)"),
]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    d = tmp_path_factory.mktemp("nvfp4")
    # the real row width (160 values: 80 code + 10 scale bytes); block scales include NaN codes
    synth.write_checkpoint(d, layout="radixark", rows_per_shard=3001, num_shards=5, last_rows=77, per_file=2,
                           dtype="NVFP4", width=160, scale=0.0123, scales_apart=True)
    t = open_table(d)
    yield t
    t.close()


@pytest.fixture(scope="module")
def nan_rows(table):
    """The rows whose block scales hold a NaN code (~7% of them): every lookup below includes one,
    so each comparison exercises the NaN case (random ids alone missed it: a one-row lookup holds
    one with p ~0.07; the first GPU run, 2026-12-06, failed there and compared nothing)."""
    ids = np.arange(table.num_rows)
    nan = _cpu(table, ids, torch.float32).isnan().flatten(1).any(1)
    out = nan.nonzero().flatten().numpy()
    assert out.size, "the synthetic table has no NaN block scale: the case would go untested"
    return out


def _cpu(table, ids, dtype):
    rows = torch.from_numpy(table.gather(ids))
    return Decoder("cpu", table.code_bytes, table.global_scale).decode(rows).to(dtype).view(*ids.shape, 160)


def _same(got, want):
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    gn, wn = got.isnan(), want.isnan()
    assert torch.equal(gn, wn) and wn.any()  # NaN block scales are in the table: the case is exercised
    bits = torch.int16 if got.element_size() == 2 else torch.int32
    assert torch.equal(got[~gn].view(bits), want[~wn].view(bits))


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_paths_decode_like_the_cpu(table, nan_rows, zero_copy, dtype):
    rng = np.random.default_rng(11)
    st = Stager(table, "cuda", out_dtype=dtype, zero_copy=zero_copy)
    for n in (1, 16, 48, 1000):  # captured graphs (<= 1024 rows)
        ids = rng.integers(0, table.num_rows, size=(n // 16 or 1, 16)) if n >= 16 else rng.integers(0, table.num_rows, size=(n,))
        ids.flat[0] = rng.choice(nan_rows)
        for _ in range(2):  # the second call replays the captured graph
            _same(st.lookup(ids), _cpu(table, ids, dtype))
        out = torch.empty(*ids.shape, 160, dtype=dtype, device="cuda")
        for _ in range(2):
            assert st.lookup(ids, out=out) is out
            _same(out, _cpu(table, ids, dtype))
    big = rng.integers(0, 300, size=(200, 16))  # 3,200 rows, many repeats: the deduplicated eager path
    big.flat[0] = rng.choice(nan_rows)
    _same(st.lookup(big), _cpu(table, big, dtype))
    torch.cuda.synchronize()
