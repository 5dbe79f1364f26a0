"""The selfcheck matrix in this release equals what the registry declares for its base."""

from __future__ import annotations


def test_selfcheck_matrix_matches_registry(registered, gates, base):
    from flash_vllm import compat
    from flash_vllm.registry import Context, catalogue
    from flash_vllm.selfcheck import evaluate

    ctx = Context(compat.resolve(registered["vllm"], {}), gates)
    rows = evaluate(ctx)  # check + apply twice + verify / upstream_check, on the patched process
    got = {r["number"]: r["status"] for r in rows}
    assert {n: s for n, s in got.items() if s == "broken"} == {}, rows
    assert got == {p.number: p.expected_status(base) for p in catalogue()}
