"""`flash bench`: the ABBA plan, the statistics, and a real (small) run against two stand-ins."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flash_cli.__main__ import main
from flash_cli.gates import bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standin"))
from harness import StandIn  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_plan_alternates_abba_per_point():
    pts = bench.plan(["A", "B"], [1, 2], [512], 4)
    first = [p.target for p in pts if p.kind == "decode" and p.param == 1]
    assert first == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert len(pts) == (2 + 1) * 4 * 2
    assert [p.repeat for p in pts if p.kind == "prefill" and p.target == "A"] == [0, 1, 2, 3]
    assert {p.target for p in bench.plan(["solo"], [1], [64], 2)} == {"solo"}


def test_summary_medians_spread_and_ratio():
    recs = [{"target": t, "kind": "decode", "param": 1, "repeat": i, "aggregate_tok_s": v, "per_stream_tok_s": v, "ttft_s": 0.1}
            for t, vals in (("A", [10, 12, 11]), ("B", [20, 25, 22])) for i, v in enumerate(vals)]
    recs.append({"target": "B", "kind": "decode", "param": 1, "repeat": 3, "error": "HTTP 500"})
    s = bench.summarize(recs)
    a = s["results"]["A"]["decode"]["1"]["aggregate_tok_s"]
    assert a == {"n": 3, "median": 11, "min": 10, "max": 12, "spread_pct": pytest.approx(200 / 11)}
    assert s["ratio_b_over_a"]["decode"]["1"]["aggregate_tok_s"] == pytest.approx(2.0)
    assert s["errors"] == 1
    assert any("B/A decode 1: 2.000x" in line for line in bench.table(s))


def test_bad_levels_are_usage_errors(capsys):
    assert main(["bench", "--dry-run", "--url", "http://127.0.0.1:9", "BENCH_CONCURRENCY=1,,x"]) == 2
    assert main(["bench", "--dry-run", "--url", "http://a:1", "--url", "http://b:1", "--label", "x", "--label", "x"]) == 2
    assert main(["bench", "--dry-run", "--url", "http://a:1", "--url", "http://b:1", "--url", "http://c:1"]) == 2


def test_dry_run_prints_the_plan_and_sends_nothing(capsys):
    assert main(["bench", "BENCH_REPEATS=2", "BENCH_CONCURRENCY=1,4", "BENCH_PREFILL=1024",
                 "--dry-run", "--json", "--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:10"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["points"] == 12 and doc["order"][:4] == ["A:decode:1#0", "B:decode:1#0", "B:decode:1#1", "A:decode:1#1"]


def test_real_run_against_two_standins_writes_raw_summary_and_plots(tmp_path, capsys):
    out = tmp_path / "res"
    # prefill slow enough (512 tokens ≈ 0.26 s cold) that a loaded CI box cannot blur cold vs hit
    slow_prefill = {"STANDIN_PREFILL_TPS": "2000"}
    with StandIn(env=slow_prefill) as a, StandIn(env={**slow_prefill, "STANDIN_DECODE_TPS": "100"}) as b:
        rc = main(["bench", "BENCH_REPEATS=2", "BENCH_CONCURRENCY=1,2", "BENCH_PREFILL=512", "BENCH_DECODE_TOKENS=24",
                   "--url", a.url, "--url", b.url, "--label", "fast", "--label", "slow", "--out", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    raw = [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]
    assert len(raw) == (2 + 1) * 2 * 2 and not [r for r in raw if "error" in r]
    assert [r["target"] for r in raw if r["kind"] == "prefill"] == ["fast", "slow", "slow", "fast"]
    pre = [r for r in raw if r["kind"] == "prefill"]
    assert all(r["ttft_hit_s"] < r["ttft_cold_s"] and r["cached_tokens"] > 0 for r in pre)
    # a server decoding at 100 tok/s against one at 400: the ratio must show it (0.25 unloaded; the
    # fixed per-request overhead of a loaded 2-core box pulls it up, 0.7 leaves ~0.35 s of slack)
    assert summary["ratio_b_over_a"]["decode"]["1"]["per_stream_tok_s"] < 0.7
    for name in ("meta.json", "summary.json", "decode_aggregate.png", "decode_per_stream.png", "prefill.png", "ttft.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "decode_aggregate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["machine"]["cpus"] and [t["label"] for t in meta["targets"]] == ["fast", "slow"]
    assert main(["bench", "--url", a.url, "--out", str(out)]) == 2  # never mixes two runs in one folder
