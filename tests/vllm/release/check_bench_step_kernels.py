"""lab/bench_step_kernels.py against each release's real classes (CPU): its stock draft head is
vLLM's own LogitsProcessor + unquantized head method and patch 10's reduced head equals it on the
id set; its stock QSA top-k is the release's `qsa_indexer._topk` (vLLM's own even after the
plugin hooked it); 0.29, which inlines that dispatch, is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flash_common import releases

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bk():
    from lab import bench_step_kernels  # the repository root is on sys.path (`python -m pytest` from it)

    return bench_step_kernels


def test_draft_head_smoke_uses_vllms_logits_processor(bk, capsys):
    assert bk.main(["--cpu-smoke", "--only", "draft_head"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    checks = [r for r in lines if r["kind"] == "check"]
    assert len(checks) == len(bk.make_plan("cpu-smoke").draft_tokens)
    for c in checks:
        assert c["stock_impl"] == "vllm.LogitsProcessor", c["stock_impl"]
        assert c["ok"] and c["minus_inf_elsewhere"] and c["within_2ulp"]
    assert lines[-1]["checks_passed"] == len(checks) and lines[-1]["errors"] == []


def test_stock_qsa_topk_is_the_releases_own(bk, base, registered):
    import vllm.models.qwen4_exp.nvidia.ops as ops_pkg

    if releases.cap(base, "qsa_topk_site") != "indexer":  # 0.29: inline in qsa_select_paged_tokens
        with pytest.raises(bk.BenchError, match="0.30"):
            bk.stock_qsa_topk()
        return
    from vllm.models.qwen4_exp.nvidia.ops import qsa_indexer

    assert getattr(qsa_indexer._topk, "__flash_patch__", None) == 5  # the session's plugin hooked it
    fn = bk.stock_qsa_topk()
    assert not hasattr(fn, "__flash_patch__") and fn is qsa_indexer._topk.__flash_original__
    assert fn.__module__ == qsa_indexer.__name__ and ops_pkg.__name__ in fn.__module__
