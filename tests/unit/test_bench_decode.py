"""tools/bench_decode.py without a GPU: the model dir it prepares (real config, table in range),
the three server configurations, and the summary/plot of raw rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bd():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "tools" / "bench_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def prepared(bd, tmp_path_factory):
    d = tmp_path_factory.mktemp("bd") / "run"
    assert bd.main(["prepare", str(d), "--quant", "fp8", "--ple-rows", "50000"]) == 0
    return d


def test_prepared_table_serves_every_hashed_id(bd, prepared):
    from flash_vllm.ple import PLETable
    from flash_vllm.ple.hashing import PLELayout, ngram_ids

    cfg = json.loads((prepared / "model" / "config.json").read_text())
    text = cfg["text_config"]
    assert text["hidden_size"] == 2560 and text["num_experts"] == 512 and text["ple_layer_ids"] == [2]
    assert text["ngram_vocab_size_base"] < bd.FULL_NGRAM_BASE  # reduced, and said so
    meta = json.loads((prepared / "meta.json").read_text())
    assert not meta["full_table"] and "reduced table" in meta["note"]
    layout = PLELayout.from_config(cfg)
    t = PLETable.from_checkpoint(prepared / "ple", layer=1)
    assert t.num_rows == layout.num_rows == meta["ple_rows"] and t.head_dim == 160
    ids = ngram_ids(np.random.default_rng(0).integers(0, 248_320, 500), layout)
    assert ids.max() < t.num_rows and ids.shape[1] == 16
    rows = t.gather(ids[:64])
    assert not ((rows & 0x7F) == 0x7F).any()  # finite fp8: no NaN codes fed to the model


def test_quant_configs(bd):
    qc, hq = bd.quant_config("fp8")
    experts = qc["quantized_layers"]["model.language_model.layers.0.mlp.experts"]
    assert experts == {"quant_algo": "FP8_PB_WO", "group_size": 128}
    assert hq["quantization"]["quantized_layers"]["model.language_model.layers.0.mlp.experts"]["quant_algo"] == "FP8_BLOCK_SCALES"
    qc4, _ = bd.quant_config("nvfp4")
    assert qc4["quantized_layers"]["model.language_model.layers.47.mlp.experts"]["quant_algo"] == "NVFP4"
    assert bd.memory_estimate("fp8")["total_gib"] < bd.GPU_GIB < 2 * bd.memory_estimate("nvfp4")["total_gib"] + 20


def test_plan_modes(bd, prepared):
    plan = bd.server_plan(prepared, 8123)
    assert set(plan) == {"stock", "eager", "hoisted"}
    assert "VLLM_PLE_MMAP" not in plan["stock"]["env"] and '{"cpu_offload":false}' in plan["stock"]["argv"]
    stock_cc = json.loads(plan["stock"]["argv"][plan["stock"]["argv"].index("--compilation-config") + 1])
    assert stock_cc["cudagraph_mode"] == "FULL_AND_PIECEWISE"  # vLLM's default, spelled out
    for name, mode, graphs in (("eager", "eager", "PIECEWISE"), ("hoisted", "hoisted", "FULL_AND_PIECEWISE")):
        assert plan[name]["env"]["VLLM_PLE_MMAP_MODE"] == mode
        assert plan[name]["env"]["VLLM_PLE_MMAP_DIR"] == str(prepared / "ple")
        cc = json.loads(plan[name]["argv"][plan[name]["argv"].index("--compilation-config") + 1])
        assert cc["cudagraph_mode"] == graphs
    for p in plan.values():
        assert '{"method":"mtp","num_speculative_tokens":2}' in p["argv"] and "dummy" in p["argv"]


def test_summary_and_plot(bd, tmp_path):
    rows = [{"label": lab, "concurrency": c, "aggregate_tok_s": v * c, "per_stream_tok_s": v, "mtp_acceptance_length": 1.1}
            for lab, v in (("stock", 100.0), ("eager", 50.0), ("hoisted", 90.0)) for c in (1, 4) for _ in range(3)]
    rows.append({"label": "eager", "concurrency": 1, "error": "HTTP 500"})  # errors are kept raw, not averaged
    f = tmp_path / "raw.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = bd.summarize(rows)
    assert s["hoisted"][4]["aggregate_tok_s"] == 360.0 and s["eager"][1]["n"] == 3
    png = tmp_path / "decode.png"
    assert bd.main(["plot", str(f), "--out", str(png)]) == 0 and png.stat().st_size > 1000


@pytest.mark.parametrize("argv, msg", [
    (["prepare", "x", "--ple-rows", "lots"], "--ple-rows 'lots'"),
    (["run", "http://h:1", "--label", "a", "--out", "o", "--levels", "1,x"], "--levels '1,x'"),
])
def test_bad_arguments_name_the_value(bd, argv, msg):
    with pytest.raises(SystemExit, match=msg):
        bd.main(argv)


def test_greedy_cases_and_diff(bd, tmp_path, capsys):
    cases = dict(bd.greedy_cases(eos=5, vocab=2000))
    assert cases["long"] == cases["long-again"] and cases["shared-prefix"][:1024] == cases["long"][:1024]
    assert cases["eos-inside"].count(5) == 2 and cases["eos-last"][-1] == 5
    assert cases == dict(bd.greedy_cases(eos=5, vocab=2000))  # fixed: the same prompts for every server
    a = {"cases": [{"name": "x", "token_ids": [1, 2, 3]}]}
    b = {"cases": [{"name": "x", "token_ids": [1, 2, 4]}]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert bd.main(["greedy-diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert bd.main(["greedy-diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert "token 2: 3 vs 4" in capsys.readouterr().out
