"""lab/bench_decode.py (lab/decode/) without a GPU: the model dir it prepares (real config, table in range),
the three server configurations, and the summary/plot of raw rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lab import bench_decode
from lab.decode import client, extrapolate, greedy, model, schedule, servers, stats

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("bd") / "run"
    assert bench_decode.main(["prepare", str(d), "--quant", "fp8", "--ple-rows", "50000"]) == 0
    return d


def test_prepared_table_serves_every_hashed_id(prepared):
    from flash_vllm.ple import PLETable
    from flash_vllm.ple.hashing import PLELayout, ngram_ids

    cfg = json.loads((prepared / "model" / "config.json").read_text())
    text = cfg["text_config"]
    assert text["hidden_size"] == 2560 and text["num_experts"] == 512 and text["ple_layer_ids"] == [2]
    assert text["ngram_vocab_size_base"] < model.FULL_NGRAM_BASE  # reduced, and said so
    meta = json.loads((prepared / "meta.json").read_text())
    assert not meta["full_table"] and "reduced table" in meta["note"]
    layout = PLELayout.from_config(cfg)
    t = PLETable.from_checkpoint(prepared / "ple", layer=1)
    assert t.num_rows == layout.num_rows == meta["ple_rows"] and t.head_dim == 160
    ids = ngram_ids(np.random.default_rng(0).integers(0, 248_320, 500), layout)
    assert ids.max() < t.num_rows and ids.shape[1] == 16
    rows = t.gather(ids[:64])
    assert not ((rows & 0x7F) == 0x7F).any()  # finite fp8: no NaN codes fed to the model


def test_quant_configs():
    qc, hq = model.quant_config("fp8")
    experts = qc["quantized_layers"]["model.language_model.layers.0.mlp.experts"]
    assert experts == {"quant_algo": "FP8_PB_WO", "group_size": 128}
    assert hq["quantization"]["quantized_layers"]["model.language_model.layers.0.mlp.experts"]["quant_algo"] == "FP8_BLOCK_SCALES"
    qc4, _ = model.quant_config("nvfp4")
    assert qc4["quantized_layers"]["model.language_model.layers.47.mlp.experts"]["quant_algo"] == "NVFP4"
    assert model.memory_estimate("fp8")["total_gib"] < model.GPU_GIB < 2 * model.memory_estimate("nvfp4")["total_gib"] + 20


def test_plan_modes(prepared):
    plan = servers.server_plan(prepared, 8123)
    assert set(plan) == {"stock", "eager", "hoisted", "hoisted-dedup256"}
    assert plan["stock"]["env"]["VLLM_PLE_MMAP"] == "0" and '{"cpu_offload":false}' in plan["stock"]["argv"]
    stock_cc = json.loads(plan["stock"]["argv"][plan["stock"]["argv"].index("--compilation-config") + 1])
    assert stock_cc["cudagraph_mode"] == "FULL_AND_PIECEWISE"  # vLLM's default, spelled out
    for name, mode, graphs in (("eager", "eager", "PIECEWISE"), ("hoisted", "hoisted", "FULL_AND_PIECEWISE"),
                                 ("hoisted-dedup256", "hoisted", "FULL_AND_PIECEWISE")):
        assert plan[name]["env"]["VLLM_PLE_MMAP_MODE"] == mode
        assert plan[name]["env"]["VLLM_PLE_MMAP_DIR"] == str(prepared / "ple")
        cc = json.loads(plan[name]["argv"][plan[name]["argv"].index("--compilation-config") + 1])
        assert cc["cudagraph_mode"] == graphs
    for p in plan.values():
        assert '{"method":"mtp","num_speculative_tokens":2}' in p["argv"] and "dummy" in p["argv"]


def test_summary_and_plot(tmp_path):
    rows = [{"label": lab, "concurrency": c, "aggregate_tok_s": v * c, "per_stream_tok_s": v, "mtp_acceptance_length": 1.1}
            for lab, v in (("stock", 100.0), ("eager", 50.0), ("hoisted", 90.0)) for c in (1, 4) for _ in range(3)]
    rows.append({"label": "eager", "concurrency": 1, "error": "HTTP 500"})  # errors are kept raw, not averaged
    f = tmp_path / "raw.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = stats.summarize(rows)
    assert s["hoisted"][4]["aggregate_tok_s"] == 360.0 and s["eager"][1]["n"] == 3
    png = tmp_path / "decode.png"
    assert bench_decode.main(["plot", str(f), "--out", str(png)]) == 0 and png.stat().st_size > 1000


def _pairs(ratio_of, n=9):
    """Stock and hoisted rows at 2 layer counts × 3 concurrencies × `n` // 6 + 1 repeats; stock's
    own speed swings ±30% between repeats (shared by its pair), hoisted = stock × ratio_of(i)."""
    rows, i = [], 0
    for L in (4, 8):
        for c in (1, 4, 8):
            for rep in range(n // 6 + 1):
                base = 100.0 * (1 + 0.3 * ((rep % 3) - 1))
                rows += [{"label": "stock", "layers": L, "concurrency": c, "repeat": rep, "per_stream_tok_s": base},
                         {"label": "hoisted", "layers": L, "concurrency": c, "repeat": rep,
                          "per_stream_tok_s": base * ratio_of(i)}]
                i += 1
    return rows


def test_paired_ratios_judge_the_goal_by_their_interval():
    # the pair shares the window's swing, so a steady 0.95x is met however much stock itself moves
    met = stats.paired(_pairs(lambda i: 0.95 + 0.01 * (i % 3 - 1)))["hoisted"]
    assert met["verdict"] == "met" and met["geomean"] == pytest.approx(0.95, abs=0.005)
    assert 0.90 < met["ci95"][0] < 0.95 < met["ci95"][1] < 0.96 and set(met["by_concurrency"]) == {1, 4, 8}
    assert stats.paired(_pairs(lambda i: 0.6 + 0.02 * (i % 3)))["hoisted"]["verdict"] == "missed"
    # 0.92 on average, ±25% pair to pair: the interval straddles 0.90 and says how many pairs it would take
    noisy = stats.paired(_pairs(lambda i: 0.92 * (1.25, 0.8, 1.0)[i % 3], n=18))["hoisted"]
    assert noisy["verdict"] == "open" and noisy["ci95"][0] < 0.90 < noisy["ci95"][1]
    assert noisy["pairs_needed"] > noisy["pairs"] == 24
    assert stats.paired(_pairs(lambda i: 0.92 * (1.25, 0.8, 1.0)[i % 3], n=18))["hoisted"] == noisy  # fixed seed


def test_paired_judges_each_concurrency_too():
    """run6's shape: pooled, the mean sits on the goal (open), while one level misses it on its own."""
    at = {1: 0.95, 4: 0.96, 8: 0.80}
    rows = _pairs(lambda i: 1.0, n=30)
    for r in rows:  # hoisted = stock x the level's ratio, ±2% pair to pair
        if r["label"] == "hoisted":
            r["per_stream_tok_s"] *= at[r["concurrency"]] * (1 + 0.02 * ((r["repeat"] % 3) - 1))
    h = stats.paired(rows)["hoisted"]
    assert h["verdict"] == "open" and h["ci95"][0] < 0.90 < h["ci95"][1]
    per = h["per_concurrency"]
    assert set(per) == {1, 4, 8} and per[8]["verdict"] == "missed" and per[8]["ci95"][1] < 0.90
    assert per[1]["verdict"] == per[4]["verdict"] == "met" and per[1]["pairs"] == 12
    assert per[8]["geomean"] == pytest.approx(0.80, abs=0.005) == h["by_concurrency"][8]
    # a level with one pair has no interval, and says so
    one = stats.paired([r for r in rows if r["concurrency"] != 1 or r["repeat"] == 0])["hoisted"]["per_concurrency"][1]
    assert one["pairs"] == 2 and one["verdict"] == "met" and one["ci95"] == [0.931, 0.931]  # two equal pairs
    lone = stats.paired([r for r in rows if r["concurrency"] != 1 or (r["repeat"] == 0 and r["layers"] == 4)])
    assert lone["hoisted"]["per_concurrency"][1] == {"pairs": 1, "geomean": 0.931, "verdict": "open",
                                                     "why": "one pair: no interval",
                                                     "added_ms": {"mean": 1.059}}  # 1000/(70 x 0.931) - 1000/70


def _cells(step_ms: dict, added_ms: float, reps: int = 3, jitter: float = 0.05) -> list[dict]:
    """Stock at {(layers, concurrency): ms per step} and hoisted `added_ms` slower, `reps` pairs each,
    the pair sharing a ±`jitter` swing (each row's per-stream tok/s is 1000 / its ms)."""
    rows = []
    for (L, c), ms in step_ms.items():
        for rep in range(reps):
            m = ms * (1 + jitter * ((rep % 3) - 1))
            rows += [{"label": "stock", "layers": L, "concurrency": c, "repeat": rep, "aggregate_tok_s": c * 1000 / m,
                      "per_stream_tok_s": 1000 / m},
                     {"label": "hoisted", "layers": L, "concurrency": c, "repeat": rep,
                      "aggregate_tok_s": c * 1000 / (m + added_ms), "per_stream_tok_s": 1000 / (m + added_ms)}]
    return rows


def test_added_ms_and_the_estimate_at_48_layers():
    # stock: 5 ms + 0.2 ms per layer at c=1 and c=8; hoisted adds 1 ms per step whatever the layers
    rows = _cells({(L, c): 5 + 0.2 * L for L in (4, 8) for c in (1, 8)}, 1.0)
    pair = stats.paired(rows)
    add = pair["hoisted"]["per_concurrency"][8]["added_ms"]
    assert add["mean"] == pytest.approx(1.0, abs=1e-3) and add["ci95"][0] <= 1.0 <= add["ci95"][1]
    est = stats.at_layers(stats.summarize(rows), pair)
    assert est["stock_ms_L48"][1] == pytest.approx(14.6, abs=0.01)  # 5 + 0.2 x 48
    assert est["hoisted"][8]["ratio"] == pytest.approx(14.6 / 15.6, abs=1e-3) and "bound" not in est["hoisted"][8]
    assert "floors" not in est and "eager" not in est


def test_the_48_layer_estimate_refuses_a_falling_line_and_floors_it():
    # at c=8 the cells' noise made stock faster at 8 layers than at 4: that line is not read; c=1's is
    # a floor (a step at c=8 is not shorter than at c=1), so c=8's ratio is marked a lower bound
    rows = _cells({(4, 1): 5.8, (8, 1): 6.6, (4, 8): 7.0, (8, 8): 6.5}, 1.5)
    est = stats.at_layers(stats.summarize(rows), stats.paired(rows))
    assert "falls with the layers" in est["floors"][8] and "lower bound" in est["floors"][8]
    assert est["stock_ms_L48"][8] == est["stock_ms_L48"][1] == pytest.approx(14.6, abs=0.01)  # 5 + 0.2 x 48
    assert est["hoisted"][8]["bound"] == "lower" and est["hoisted"][8]["ratio"] == pytest.approx(14.6 / 16.1, abs=1e-3)
    # one layer count: no line at all, said so
    one = stats.at_layers(stats.summarize([r for r in rows if r["layers"] == 8]), stats.paired(rows))
    assert "no rising stock line" in one["why"] and "hoisted" not in one


def test_plot_never_pairs_rows_of_two_runs(tmp_path):
    """Two runs repeat the same (layers, concurrency, repeat) keys: each pair stays inside its file."""
    a = _cells({(8, 1): 6.0}, 0.0, reps=3)  # run a: hoisted as fast as stock
    b = [r | {"per_stream_tok_s": r["per_stream_tok_s"] * 2} for r in a]  # run b: the machine twice as fast
    fa, fb, js = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "s.json"
    fa.write_text("".join(json.dumps(r) + "\n" for r in a))
    fb.write_text("".join(json.dumps(r) + "\n" for r in b))
    assert bench_decode.main(["plot", str(fa), str(fb), "--out", str(tmp_path / "p.png"), "--json", str(js)]) == 0
    h = json.loads(js.read_text())["paired_vs_stock"]["hoisted"]
    assert h["pairs"] == 6 and h["geomean"] == 1.0 and h["min"] == h["max"] == 1.0  # crossed pairs would give 0.5 and 2


def test_paired_needs_both_sides_of_a_pair():
    rows = _pairs(lambda i: 0.9)
    rows = [r for r in rows if not (r["label"] == "stock" and r["layers"] == 8)]  # stock/L8 never booted
    assert stats.paired(rows)["hoisted"]["pairs"] == 6
    one = stats.paired(rows[:2])["hoisted"]
    assert one["verdict"] == "open" and "one pair" in one["why"] and "ci95" not in one
    assert stats.paired([r for r in rows if r["label"] == "stock"]) == {}


@pytest.mark.parametrize("argv, msg", [
    (["prepare", "x", "--ple-rows", "lots"], "--ple-rows 'lots'"),
    (["matrix", "d", "--out", "o", "--warmup-tokens", "-1"], "--warmup-tokens -1"),
    (["run", "http://h:1", "--label", "a", "--out", "o", "--levels", "1,x"], "--levels '1,x'"),
])
def test_bad_arguments_name_the_value(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        bench_decode.main(argv)


def test_greedy_cases_and_diff(tmp_path, capsys):
    cases = dict(greedy.greedy_cases(eos=5, vocab=2000))
    assert cases["long"] == cases["long-again"] and cases["shared-prefix"][:1024] == cases["long"][:1024]
    assert cases["eos-inside"].count(5) == 2 and cases["eos-last"][-1] == 5
    assert cases == dict(greedy.greedy_cases(eos=5, vocab=2000))  # fixed: the same prompts for every server
    a = {"cases": [{"name": "x", "token_ids": [1, 2, 3]}]}
    b = {"cases": [{"name": "x", "token_ids": [1, 2, 4]}]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert bench_decode.main(["greedy-diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert bench_decode.main(["greedy-diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert "token 2: 3 vs 4" in capsys.readouterr().out


def test_fewer_layers_keep_the_pattern(tmp_path):
    d = tmp_path / "L8"
    assert bench_decode.main(["prepare", str(d), "--quant", "fp8", "--ple-rows", "50000", "--layers", "8"]) == 0
    text = json.loads((d / "model" / "config.json").read_text())["text_config"]
    assert text["num_hidden_layers"] == 8 and text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    qc = json.loads((d / "model" / "config.json").read_text())["quantization_config"]["quantized_layers"]
    assert sorted(k for k in qc if k.endswith("mlp.experts") and k.startswith("model.")) == \
        sorted(f"model.language_model.layers.{i}.mlp.experts" for i in range(8))
    meta = json.loads((d / "meta.json").read_text())
    assert meta["layers"] == 8 and "8 of the real 48 layers" in meta["layers_note"]
    assert model.memory_estimate("fp8", 8)["experts_gib"] * 6 == pytest.approx(model.memory_estimate("fp8")["experts_gib"], rel=0.01)
    with pytest.raises(SystemExit, match="--layers 6"):
        bench_decode.main(["prepare", str(tmp_path / "x"), "--layers", "6"])


def test_side_by_side_plan_gives_each_config_its_port_and_a_fixed_pool(prepared):
    plan = servers.server_plan(prepared, 9000, side_by_side=True)
    ports = {c: p["argv"][p["argv"].index("--port") + 1] for c, p in plan.items()}
    assert ports == {"stock": "9000", "eager": "9001", "hoisted": "9002", "hoisted-dedup256": "9003"}
    for p in plan.values():
        assert p["argv"][p["argv"].index("--kv-cache-memory-bytes") + 1] == str(4 << 30)
    # the opt-in variant: the hoisted server with run6's threshold, c=8 x MTP=2 on the dedup side
    nd, h = plan["hoisted-dedup256"], plan["hoisted"]
    assert nd["env"] == {**h["env"], "VLLM_PLE_MMAP_DEDUP_MIN": "256"}
    assert [a for a in nd["argv"] if a != "9003"] == [a for a in h["argv"] if a != "9002"]
    from flash_vllm.ple.config import config_from_env
    assert config_from_env(nd["env"]).dedup_min == 256 <= 24 * 16  # c=8 x MTP=2 on the dedup side
    assert config_from_env(h["env"]).dedup_min > 24 * 16  # the default: on the short path
    assert servers.parse_configs("stock,hoisted-dedup256") == ["stock", "hoisted-dedup256"]
    for bad in ("stock,stock", "stock,fast", ","):
        with pytest.raises(SystemExit, match="hoisted-dedup256, each once"):
            servers.parse_configs(bad)


FAKE_VLLM = r"""#!PYTHON
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
mode = "stock" if os.environ.get("VLLM_PLE_MMAP") == "0" else os.environ["VLLM_PLE_MMAP_MODE"]
if mode in os.environ.get("FAKE_FAIL", ""):
    print("boom: cannot boot", mode, flush=True)
    sys.exit(7)
import threading
delay = {"stock": 0.002, "eager": 0.004, "hoisted": 0.0022}[mode]
drafts = [0]
# patch 1's counters as the metrics bridge carries them: one op per token, 0.25 ms and 3 rows each,
# exposed only as of the last copy, every FAKE_PLE_LAG s (the bridge's interval)
ple_live, ple_shown = [0, 0.0, 0], [0, 0.0, 0]
lock = threading.Lock()
def bridge():
    while True:
        time.sleep(float(os.environ.get("FAKE_PLE_LAG", "0.3")))
        with lock:
            ple_shown[:] = ple_live
threading.Thread(target=bridge, daemon=True).start()
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        text = ("# TYPE vllm:spec_decode_num_drafts_total counter\nvllm:spec_decode_num_drafts_total{model_name=\"bench\"} %d\n"
                "vllm:spec_decode_num_drafts_created{model_name=\"bench\"} 1.7962e+09\n"  # vLLM's counters carry these
                "vllm:spec_decode_num_accepted_tokens_total{model_name=\"bench\"} %d\n" % (drafts[0], drafts[0] // 4))
        if mode != "stock":
            with lock:
                ops, op_s, rows = ple_shown
            text += ("# TYPE vllm:ple_mmap_lookup_ops counter\nvllm:ple_mmap_lookup_ops_total %d\n"
                     "vllm:ple_mmap_lookup_ops_created 1.7962e+09\n"
                     "# TYPE vllm:ple_mmap_op_seconds counter\nvllm:ple_mmap_op_seconds_total %r\n"
                     "# TYPE vllm:ple_mmap_rows counter\nvllm:ple_mmap_rows_total %d\n" % (ops, op_s, rows))
        body = b"ok" if self.path == "/health" else text.encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert isinstance(req["prompt"], list) and req["ignore_eos"] and req["stream"]
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        for i in range(req["max_tokens"]):
            time.sleep(delay)
            drafts[0] += 1
            with lock:
                ple_live[0] += 1; ple_live[1] += 0.00025; ple_live[2] += 3
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n")
        self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": req["max_tokens"]}}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _fake_vllm(tmp_path, monkeypatch):
    import sys

    binp = tmp_path / "bin"
    binp.mkdir()
    exe = binp / "vllm"
    exe.write_text(FAKE_VLLM.replace("#!PYTHON", "#!" + sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binp}:{__import__('os').environ['PATH']}")


def test_matrix_boots_side_by_side_and_measures_in_turn(prepared, tmp_path, monkeypatch):
    _fake_vllm(tmp_path, monkeypatch)
    out = tmp_path / "raw.jsonl"
    rc = bench_decode.main(["matrix", str(prepared), "--port", "18770", "--out", str(out), "--levels", "1,2", "--tokens", "40",
                  "--repeats", "2", "--boot-timeout", "60", "--ple-settle", "0.5"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["label"] for r in rows if r.get("event") == "booted") == ["eager", "hoisted", "stock"]
    meas = [r for r in rows if "aggregate_tok_s" in r]
    # an untimed round per config and level first, kept raw as events, never summarized
    warm = [i for i, r in enumerate(rows) if r.get("event") == "warmup"]
    assert len(warm) == 3 * 2 and max(warm) < rows.index(meas[0]) and all(rows[i]["max_tokens"] == 64 for i in warm)
    assert len(meas) == 3 * 2 * 2 and all(r["layers"] == 48 and r["tokens"] == 40 * r["concurrency"] for r in meas)
    # the order rotates every repeat; the same prompts go to every config
    assert [r["label"] for r in meas if r["concurrency"] == 1] == ["stock", "eager", "hoisted", "eager", "hoisted", "stock"]
    # concurrency-major: the three configs at one level run back to back (the pairs paired() compares)
    assert [r["concurrency"] for r in meas] == [1, 1, 1, 2, 2, 2] * 2
    assert [r["label"] for r in meas][3:6] == ["eager", "hoisted", "stock"]
    assert stats.paired(rows)["hoisted"]["pairs"] == 4
    assert all(0 < r["mtp_drafts"] < 1e6 for r in meas)  # counts, never a `_created` time
    assert {r["commit"] for r in rows} == {schedule.tree_measured()} and schedule.tree_measured() != "unknown"  # this checkout's HEAD
    # patch 1's lookups per measurement, read after the bridge's lag settled: every token's op, this
    # measurement's only (the warm-up's settled before), none for stock
    for r in meas:
        if r["label"] == "stock":
            assert "ple" not in r
        else:
            assert r["ple"]["ops"] == r["tokens"] and r["ple"]["rows_per_op"] == 3.0, r
            assert r["ple"]["op_ms_per_op"] == pytest.approx(0.25) and r["ple"]["gather_ms_per_op"] == 0.0
    summ = stats.summarize(rows)
    ratio = stats.ratios(summ)
    assert set(summ) == {"stock/L48", "eager/L48", "hoisted/L48"}
    assert summ["hoisted/L48"][2]["ple"] == {"op_ms_per_op": 0.25, "gpu_wait_ms_per_op": 0.0, "dedup_ms_per_op": 0.0,
                                             "gather_ms_per_op": 0.0, "stage_ms_per_op": 0.0, "rows_per_op": 3.0, "n": 2}
    assert "ple" not in summ["stock/L48"][2]
    assert ratio["eager/L48"][1]["per_stream_tok_s"] < 0.8 < ratio["hoisted/L48"][1]["per_stream_tok_s"]


def test_matrix_records_a_config_that_cannot_boot(prepared, tmp_path, monkeypatch):
    _fake_vllm(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_FAIL", "hoisted")
    out = tmp_path / "raw.jsonl"
    rc = bench_decode.main(["matrix", str(prepared), "--port", "18780", "--out", str(out), "--levels", "1", "--tokens", "8",
                  "--repeats", "1", "--boot-timeout", "60", "--warmup-tokens", "0"])
    assert rc == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    (failed,) = [r for r in rows if r.get("event") == "boot_failed"]
    assert failed["label"] == "hoisted" and failed["exit"] == 7 and "cannot boot" in failed["tail"]
    assert sorted(r["label"] for r in rows if "aggregate_tok_s" in r) == ["eager", "stock"]
    assert not [r for r in rows if r.get("event") == "warmup"]  # --warmup-tokens 0: none


def test_extrapolation_reads_the_line_at_48_layers():
    # ms per token = 2 + 0.5 * layers  → at 48: 26 ms (38.5 tok/s); bandwidth 4,000 vs 273 GB/s
    summ = {f"hoisted/L{L}": {1: {"per_stream_tok_s": 1000.0 / (2 + 0.5 * L)}} for L in (4, 8)}
    est = extrapolate.extrapolate(summ, bw_h200_gbs=4000.0)["hoisted"]
    assert est["ms_fixed"] == pytest.approx(2.0) and est["ms_per_layer"] == pytest.approx(0.5)
    assert est["ms_per_token_L48"] == pytest.approx(26.0) and est["tok_s_L48_h200_estimate"] == pytest.approx(38.5, abs=0.1)
    assert est["gb10_tok_s_all_scaled"] == pytest.approx(1000 / (26 * 4000 / 273), abs=0.1)
    # the split: bytes read at each device's bandwidth, the rest of the step kept as measured
    step = {"fixed": 2e9, "per_layer": 0.1e9}  # 6.8 GB a step at 48 layers: 1.7 ms at 4,000 GB/s
    est = extrapolate.extrapolate(summ, bw_h200_gbs=4000.0, measured_bytes=step,
                         recipe_bytes={"fixed": 2e9, "per_layer": 0.05e9})["hoisted"]
    assert est["h200_ms_reading_weights"] == pytest.approx(1.7) and est["ms_other"] == pytest.approx(24.3)
    assert est["gb10_tok_s_estimate"] == pytest.approx(1000 / (24.3 + 6.8e9 / 273e9 * 1000), abs=0.1)
    assert est["gb10_tok_s_estimate_recipe_bytes"] == pytest.approx(1000 / (24.3 + 4.4e9 / 273e9 * 1000), abs=0.1)
    assert est["gb10_tok_s_all_scaled"] < est["gb10_tok_s_estimate"] < est["gb10_tok_s_estimate_recipe_bytes"]


def test_step_bytes_follow_the_config():
    """The recipe's step reads fewer bytes than the bench checkpoint's (NVFP4 experts, fp8 side
    layers), and with MTP=2 a layer's routed experts are read for three positions."""
    one, three = extrapolate.step_bytes(1.0, 2.0, tokens=1), extrapolate.step_bytes(1.0, 2.0, tokens=3)
    expert = 3 * 2560 * 640
    assert three["per_layer"] - one["per_layer"] == pytest.approx(20 * expert)
    assert extrapolate.RECIPE_BYTES["per_layer"] < 0.6 * extrapolate.BENCH_BYTES["per_layer"]
    assert extrapolate.BENCH_BYTES["fixed"] == extrapolate.RECIPE_BYTES["fixed"] > 3 * 248_320 * 2560 * 2
    one = extrapolate.extrapolate({"eager/L8": {1: {"per_stream_tok_s": 50.0}}})["eager"]
    assert "one layer count" in one["note"]


def test_ple_phases_per_op_and_bad_settle():
    n = client.PLE
    before = {n["ops"]: 100.0, n["op"]: 0.05, n["stage"]: 0.01, n["rows"]: 1000.0}
    after = {n["ops"]: 300.0, n["op"]: 0.15, n["stage"]: 0.05, n["rows"]: 5000.0}
    assert client.ple_phases(before, after) == {"ops": 200, "op_ms_per_op": 0.5, "gpu_wait_ms_per_op": 0.0,
                                            "dedup_ms_per_op": 0.0, "gather_ms_per_op": 0.0,
                                            "stage_ms_per_op": 0.2, "rows_per_op": 20.0}
    assert client.ple_phases(after, after) is None and client.ple_phases({}, {}) is None  # stock: no lookups
    with pytest.raises(SystemExit, match=r"--ple-settle -1.0: give 0"):
        bench_decode.main(["matrix", "x", "--out", "y", "--ple-settle", "-1"])


def test_the_gb10_band_reads_the_bytes_slower_and_keeps_the_rest():
    """2.2 GB read in a 10 ms H200 step at 1,100 GB/s leaves 8 ms of other work; on the GB10 the
    bytes take 10 ms at 220 GB/s (its whole bandwidth) to 20 ms (half), the rest 8 to 16 ms."""
    by = {"fixed": 0.2e9, "per_layer": 0.5e9}  # 0.2 + 4 x 0.5 = 2.2 GB
    band = extrapolate.gb10_band(10.0, by, 1100.0, layers=4, bw_gb10_gbs=220.0, bw_fraction=(0.5, 1.0),
                                 other_factor=(1.0, 2.0))
    assert band["gb_read"] == 2.2 and band["h200_ms_other"] == 8.0
    assert band["gb10_step_ms"] == [18.0, 36.0]
    assert band["gb10_tok_s_per_step"] == [round(1000 / 36, 1), round(1000 / 18, 1)]
    with pytest.raises(ValueError, match="cannot read 2.2 GB"):
        extrapolate.gb10_band(1.0, by, 1100.0, layers=4)


def test_the_gb10_command_takes_defaults_c1_step_from_each_report(tmp_path, capsys):
    from lab import bench_recipe

    rep = {"step_ms": {"default": {"c=4 p=64": {"step": 14.0}, "c=1 p=6144": {"step": 9.6}, "c=1 p=64": {"step": 9.4}}}}
    (tmp_path / "r.json").write_text(json.dumps(rep))
    assert bench_recipe.main(["gb10", str(tmp_path / "r.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bands"][0]["cell"] == "c=1 p=64" and out["bands"][0]["h200_step_ms"] == 9.4
    lo, hi = out["gb10_tok_s_per_step"]
    assert 10 < lo < hi < 30
    (tmp_path / "none.json").write_text(json.dumps({"step_ms": {"stock": {}}}))
    with pytest.raises(SystemExit, match="no c=1 step of the default server"):
        bench_recipe.main(["gb10", str(tmp_path / "none.json")])
