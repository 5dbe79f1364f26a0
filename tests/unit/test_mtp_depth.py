"""lab/decode/mtp_depth.py: the draft depth each rendered server runs at a concurrency, and the
acceptance at which a deeper draft pays for its measured step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab import bench_recipe as br
from lab.decode import mtp_depth as md


def test_break_even_solves_the_tokens_ratio_for_the_step_ratio():
    for lo, hi, ratio in ((1, 2, 1.2), (2, 4, 1.308), (3, 4, 1.07), (0, 1, 1.5)):
        p = md.break_even(lo, hi, ratio)
        assert 0.0 < p < 1.0
        assert md.tokens_per_step(p, hi) / md.tokens_per_step(p, lo) == pytest.approx(ratio, abs=1e-9)
    # depth 1 over 0 at ratio 1.5: 1 + p = 1.5
    assert md.break_even(0, 1, 1.5) == pytest.approx(0.5)


def test_break_even_edges_free_deeper_steps_and_unpayable_ones():
    assert md.break_even(2, 4, 0.98) == 0.0        # the deeper step is no slower: any acceptance pays
    assert md.break_even(2, 4, 5 / 3) is None      # (4 + 1) / (2 + 1): only p > 1 could pay
    assert md.break_even(1, 4, 2.4) is not None    # below (4 + 1) / (1 + 1) = 2.5
    with pytest.raises(ValueError, match="lo=3, hi=3"):
        md.break_even(3, 3, 1.1)


def _argv(name, tmp_path, port=18700):
    return br.render(name, tmp_path, port)["argv"]


def test_depth_follows_the_rendered_speed_schedule_capped_by_max_num_seqs(tmp_path):
    speed = _argv("speed", tmp_path)
    # speed.env: MTP_BY_BATCH=1:3,3:2,6:1 with 8 sequences; 16 streams run 8 at a time
    assert [md.depth(speed, c) for c in (1, 2, 3, 5, 6, 8, 16)] == [3, 3, 2, 2, 1, 1, 1]
    assert [md.depth(_argv("default-mtp4", tmp_path), c) for c in (1, 8, 16)] == [4, 4, 4]
    assert md.depth(["vllm", "serve", "m"], 4) == 0


def _rows(tmp_path, step_ms: dict[str, dict[int, float]], env_of=None) -> list[dict]:
    rows = []
    for port, name in enumerate(step_ms):
        r = br.render(name, tmp_path, 18700 + port)  # each its own port: the comparison ignores it
        env = (env_of or {}).get(name, r["env"])
        rows.append({"event": "booted", "label": name, "argv": r["argv"], "env": env})
    for name, by_c in step_ms.items():
        for c, ms in by_c.items():
            for rep in range(3):
                rows.append({"label": name, "concurrency": c, "prompt_tokens": 64, "repeat": rep,
                             "per_stream_tok_s": 1000.0 / (ms * (1 + 0.01 * rep)), "mtp_acceptance_length": 1.0})
    return rows


def test_comparisons_pair_servers_that_differ_only_in_draft_depth(tmp_path):
    rows = _rows(tmp_path, {"speed": {1: 8.0, 4: 10.0, 8: 12.0}, "default-mtp4": {1: 8.8, 4: 13.0, 8: 19.2},
                            "stock": {1: 7.0, 4: 9.0, 8: 11.0}})
    table = md.comparisons(rows)
    # stock differs in more than its speculative config (no plugin, the table on the GPU): never paired
    assert {(t["shallow"], t["deep"]) for t in table} == {("speed", "default-mtp4")}
    by = {t["cell"]: t for t in table}
    assert [by[c]["depths"] for c in ("c=1 p=64", "c=4 p=64", "c=8 p=64")] == [[3, 4], [2, 4], [1, 4]]
    assert by["c=4 p=64"]["step_ratio"]["geomean"] == pytest.approx(1.3, abs=1e-3)
    assert by["c=4 p=64"]["step_ratio"]["pairs"] == 3
    p = by["c=8 p=64"]["break_even_p"]
    assert md.tokens_per_step(p, 4) / md.tokens_per_step(p, 1) == pytest.approx(1.6, abs=2e-3)
    assert by["c=8 p=64"]["break_even_length_shallow"] == pytest.approx(1 + p, abs=1e-3)


def test_a_server_with_other_env_is_not_compared(tmp_path):
    rows = _rows(tmp_path, {"speed": {4: 10.0}, "default-mtp4": {4: 13.0}},
                 env_of={"default-mtp4": {"VLLM_QSA_DET_TOPK": "0"}})
    assert md.comparisons(rows) == []


def test_main_writes_the_table_and_fails_loudly_on_nothing_comparable(tmp_path, capsys):
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in _rows(tmp_path, {"speed": {4: 10.0}, "default-mtp4": {4: 13.0}})))
    assert md.main([str(raw), "--json", str(tmp_path / "t.json")]) == 0
    assert "speed (2)" in capsys.readouterr().out
    assert json.loads((tmp_path / "t.json").read_text())[0]["depths"] == [2, 4]
    only = tmp_path / "only.jsonl"
    only.write_text("".join(json.dumps(r) + "\n" for r in _rows(tmp_path, {"speed": {4: 10.0}})))
    assert md.main([str(only)]) == 1
    assert "no two servers" in capsys.readouterr().err


def test_default_and_speed_differ_only_in_depth_so_one_run_prices_depth_1_against_2(tmp_path):
    # GPU-E2E.md's next plan (`RECIPE_CONFIGS=default,speed --levels 4,8`) rests on this pairing
    rows = _rows(tmp_path, {"default": {1: 8.0, 4: 10.0, 8: 14.4}, "speed": {1: 8.5, 4: 10.0, 8: 11.9}})
    by = {t["cell"]: t for t in md.comparisons(rows)}
    assert set(by) == {"c=1 p=64", "c=8 p=64"}  # at c=4 both run depth 2
    assert (by["c=8 p=64"]["shallow"], by["c=8 p=64"]["depths"]) == ("speed", [1, 2])
    assert (by["c=1 p=64"]["deep"], by["c=1 p=64"]["depths"]) == ("speed", [2, 3])


# --- the step model with depth (an estimate) ------------------------------------------------------

RUN8 = str(Path(__file__).resolve().parents[2] / "benchmarks/recipe48-h200/run8-h100-32layers/raw48.jsonl")


def test_model_step_at_the_fitted_depth_is_pieces_decode_step():
    from lab.decode import model, pieces

    corner = {"idle": 60.0, "e": 250.0, "s": 0.4, "fixed": 0.0}
    for c in (1, 2, 4, 8):
        assert md.model_step(c, model.MTP, corner, draft=5.0) == pytest.approx(pieces.decode_step(c, corner))
    # one draft more: the draft pass plus the experts and work of c more tokens
    assert md.model_step(4, 3, corner, 5.0) > md.model_step(4, 2, corner, 5.0) + 5.0


def test_a_draft_pass_reads_the_head_and_more_of_the_mtp_experts_as_streams_grow():
    assert md.draft_ms(8, 273.0) > md.draft_ms(1, 273.0)
    assert md.draft_ms(4, 546.0) == pytest.approx(md.draft_ms(4, 273.0) / 2)
    # patch 10's head alone (65,536 x 2,560 bf16, 0.34 GB) is ~1.2 ms at 273 GB/s
    assert 1.2 < md.draft_ms(1, 273.0) < 2.0


def test_the_model_fitted_at_depth_2_predicts_run8s_depth_costs_within_5_percent():
    from lab.decode import recipe_report

    rows = recipe_report.load_rows([RUN8])
    check = md.h100_check(rows, md.comparisons(rows))
    assert {h["cell"] for h in check} == {"c=1 p=64", "c=4 p=64", "c=8 p=64", "c=16 p=64", "c=4 p=6144"}
    assert next(h for h in check if h["cell"] == "c=16 p=64")["running"] == 8
    for h in check:
        lo, hi = h["predicted"]
        assert lo * 0.95 <= h["measured"] <= hi * 1.05, h


def test_the_gb10_estimate_covers_each_depth_pair_and_a_deeper_draft_needs_more_at_8_streams_than_1():
    gb10 = md.gb10_table()
    assert len(gb10["rows"]) == len(md.GB10_CONCURRENCY) * len(md.GB10_PAIRS)
    for lo, hi in md.GB10_PAIRS:
        ps = [r["break_even_p"] for r in gb10["rows"] if r["depths"] == [lo, hi]]
        assert all(0.0 < a <= b < 1.0 for a, b in ps)
        assert ps[0][1] < ps[-1][0]   # 8 streams need more than 1 does: their verification reads more experts


def test_main_with_model_writes_the_check_and_the_estimate(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert md.main([RUN8, "--model", "--json", str(out)]) == 0
    assert "a GB10 at 48 layers, an estimate" in capsys.readouterr().out
    assert set(json.loads(out.read_text())) == {"measured", "model_check_h100", "model_gb10_estimate"}
