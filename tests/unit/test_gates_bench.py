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


def test_acceptance_from_counter_deltas():
    before = {"drafts": 100.0, "accepted": 150.0, "per_pos": {0: 90.0, 1: 60.0}}
    after = {"drafts": 300.0, "accepted": 450.0, "per_pos": {0: 270.0, 1: 180.0}}
    got = bench.acceptance(before, after)
    assert got["mtp_acceptance_length"] == pytest.approx(2.5) and got["mtp_drafts"] == 200
    assert got["mtp_acceptance_per_position"] == pytest.approx([0.9, 0.6])
    assert bench.acceptance(None, after) == {} and bench.acceptance(before, before) == {}
    no_pos = bench.acceptance({**before, "per_pos": {}}, {**after, "per_pos": {}})
    assert "mtp_acceptance_per_position" not in no_pos and no_pos["mtp_acceptance_length"] == pytest.approx(2.5)


def test_mtp_acceptance_is_measured_per_decode_point_from_the_servers_counters(tmp_path, capsys):
    """One stand-in drafts (MTP=2, acceptance decaying with the position, as vLLM's V1 counters
    report it), the other has no drafter: the first gets an acceptance length per point, the
    second none, and the summary compares the two on it."""
    out = tmp_path / "res"
    with StandIn("--speculative-config", '{"method":"mtp","num_speculative_tokens":2}') as a, StandIn() as b:
        rc = main(["bench", "BENCH_REPEATS=2", "BENCH_CONCURRENCY=1,2", "BENCH_PREFILL=256", "BENCH_DECODE_TOKENS=60",
                   "--url", a.url, "--url", b.url, "--label", "mtp", "--label", "plain", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    raw = [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines()]
    mtp = [r for r in raw if r["kind"] == "decode" and r["target"] == "mtp"]
    assert len(mtp) == 4 and all(2.3 < r["mtp_acceptance_length"] <= 2.6 for r in mtp)
    assert all(len(r["mtp_acceptance_per_position"]) == 2 for r in mtp)
    assert all(r["mtp_acceptance_per_position"][0] > r["mtp_acceptance_per_position"][1] > 0 for r in mtp)
    # each point's drafts are its own requests' (the counters' deltas, not their totals)
    assert all(r["mtp_drafts"] == r["tokens"] // 60 * 20 for r in mtp)
    assert not [r for r in raw if r["target"] == "plain" and "mtp_acceptance_length" in r]
    assert "MTP acceptance length 2." in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"]["mtp"]["decode"]["1"]["mtp_acceptance_length"]["n"] == 2
    assert summary["results"]["plain"]["decode"]["1"]["mtp_acceptance_length"] == {"n": 0}
    assert (out / "decode_acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_prompts_come_from_the_prompts_file(tmp_path, capsys):
    from flash_cli.gates.client import Stream

    sent = []

    class Recorder:  # bench's side of the client only: what each stream was asked
        def stream(self, path, body):
            sent.append(body["messages"][0]["content"])
            return Stream(200, sent=1.0, first=1.1, end=2.0, pieces=["x"] * 5, usage={"completion_tokens": 5})

    f = tmp_path / "p.txt"
    f.write_text("# traffic sample\n请用三句话解释什么是页缓存。\n\n用中文写一首关于大海的短诗。\n", encoding="utf-8")
    prompts = bench.read_prompts(f)
    assert prompts == ("请用三句话解释什么是页缓存。", "用中文写一首关于大海的短诗。")
    assert "error" not in bench._decode(Recorder(), "m", 3, 8, "s", prompts)
    assert sorted(p.split("] ", 1)[1] for p in sent) == sorted([prompts[0], prompts[1], prompts[0]])  # threads: any order
    assert bench.prompts_source(f, prompts)["count"] == 2
    with StandIn() as a:
        out = tmp_path / "res"
        assert main(["bench", "BENCH_REPEATS=1", "BENCH_CONCURRENCY=1", "BENCH_PREFILL=64", "BENCH_DECODE_TOKENS=8",
                     "--url", a.url, "--prompts", str(f), "--out", str(out), "--no-plots"]) == 0
        meta = json.loads((out / "meta.json").read_text())
        assert meta["decode_prompts"] == {"file": str(f), "count": 2, "sha256": bench.prompts_source(f, prompts)["sha256"]}
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    capsys.readouterr()
    assert main(["bench", "--dry-run", "--url", "http://127.0.0.1:9", "--prompts", str(empty)]) == 2
    assert "empty.txt: no prompts in it" in capsys.readouterr().err
    assert main(["bench", "--dry-run", "--url", "http://127.0.0.1:9", "--prompts", str(tmp_path / "nope.txt")]) == 2
