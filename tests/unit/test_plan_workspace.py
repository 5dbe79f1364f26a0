"""The QSA logits workspace `flash plan` counts outside vLLM's budget (flash_cli/plan/workspace.py).
The vllm tier (check_logits_workspace.py) holds the sizes to each release's own function."""

from __future__ import annotations

import json

import pytest

from flash_cli.__main__ import main
from flash_cli.plan import workspace

MIB = 2**20


@pytest.mark.parametrize("base, ctx, batched, want", [
    ("v0.33", 500_000, 8_192, 512 * MIB),           # whole, whatever the prompt
    ("v0.33", 2_048, 16, 512 * MIB),
    ("v0.31", 500_000, 8_192, 512 * MIB),
    ("v0.30", 500_000, 8_192, 1_073 * 125_056 * 4),  # rows per chunk × cdiv(CTX, 4) rounded to 64 × 4 B
    ("v0.30", 500_000, 256, 256 * 125_056 * 4),      # fewer rows in the step than a chunk holds
    ("v0.29", 500_000, 8_192, 268 * 125_200 * 4),    # rows per 128 MiB chunk × the table's 313 pages × 400 rows
    ("v0.29", 2_048, 2_048, 2_048 * 800 * 4),         # short CTX: the whole step in one chunk
])
def test_sizes(base, ctx, batched, want):
    assert workspace.qsa_logits_bytes(base, ctx, 1_600, 4, batched) == want


def test_a_larger_cap_moves_it_and_a_table_wider_than_the_cap_wins():
    assert workspace.qsa_logits_bytes("v0.33", 500_000, 1_600, 4, 8_192, max_logits_mb=64) == 64 * MIB
    ctx = 600_000_000  # 150M compressed rows × 4 B: more than 512 MiB, the workspace grows to the row
    assert workspace.qsa_logits_bytes("v0.33", ctx, 1_600, 4, 8_192) == workspace.table_columns(ctx, 1_600, 4) * 4


def test_the_plan_takes_it_from_the_page_cache_and_says_so(capsys):
    assert main(["plan", "default", "--hardware", "gb10", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    host, b = p["host"], p["budget"]
    # the logits' 0.5 GiB and patch 10's 0.3125 GiB copy of the draft head (booked after vLLM's profile peak)
    assert b["draft_head_outside_gib"] == 0.312
    assert b["outside_budget_gib"] == host["outside_budget_gib"] == 0.812
    left = host["host_total_gib"] - host["vllm_claim_gib"] - host["os_reserve_gib"] - host["vllm_pre_snapshot_gib"]
    assert host["page_cache_for_ple_gib"] == pytest.approx(left - 0.8125, abs=0.002)
    assert any(a.startswith("outside the budget: the QSA indexer's float32 logits, up to 0.5 GiB")
               for a in p["assumptions"])
    assert main(["plan", "v0.29", "--hardware", "gb10"]) == 0
    out = capsys.readouterr().out
    assert ("  outside        up to 0.437 GiB beyond GPU_MEM: the QSA indexer's logits (0.125 GiB from the first "
            "prefill on)") in out and "patch 10's draft-head copy (0.312 GiB)" in out
    assert "v0.29: chunks of at most 128 MiB" in out
