"""`flash plan` contract, hardware presets and detection, and the doctor/status hooks."""

from __future__ import annotations

import json

import pytest

from flash_cli.__main__ import main
from flash_cli.plan import build, doctor_findings, status_comparison
from flash_cli.plan import hardware as H
from flash_cli.settings import resolve

GB10 = H.PRESETS["gb10"]
REQUIRED = {"kv_cache_tokens", "kv_bytes_per_token", "weights_gib", "max_concurrency", "weights", "kv_layout",
            "budget", "host", "assumptions", "findings"}


def run_json(capsys, *argv):
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)  # the whole stdout is ONE object


def plan(**values):
    return build(resolve(None, None, {k: str(v) for k, v in values.items()}), GB10, snapshot=None)


def test_json_contract(capsys):
    rc, obj = run_json(capsys, "default", "--hardware", "gb10")
    assert rc == 0 and REQUIRED <= obj.keys()
    assert obj["profile"] == "default" and obj["hardware"]["name"] == "gb10"
    assert isinstance(obj["kv_cache_tokens"], int) and obj["kv_cache_tokens"] > 100_000
    lo, hi = obj["kv_cache_tokens_range"]
    assert lo <= obj["kv_cache_tokens"] <= hi
    b = obj["budget"]
    parts = b["weights_gib"] + b["activations_gib"] + b["topk_buffers_gib"] + b["runtime_overhead_gib"] + b["kv_cache_gib"]
    assert parts == pytest.approx(b["requested_gib"], abs=0.01)
    # patch 10's copy of the draft head is a weight held outside the budget (vLLM books it after its profile)
    assert b["draft_head_outside_gib"] == pytest.approx(obj["weights"]["gib"]["draft_head_copy"], abs=0.001)
    assert b["draft_head_outside_gib"] > 0
    assert obj["weights_gib"] + b["draft_head_outside_gib"] == pytest.approx(sum(obj["weights"]["gib"].values()), abs=0.01)
    assert all(f["level"] in ("ok", "warn", "fail", "info") for f in obj["findings"])


def test_first_word_with_equals_means_default_profile(capsys):
    _, obj = run_json(capsys, "GPU_MEM=0.7", "--hardware", "gb10")
    assert obj["profile"] == "default" and obj["recipe"]["GPU_MEM"] == 0.7


def test_bad_hardware_exits_2_naming_the_presets(capsys):
    assert main(["plan", "--hardware", "tpu-v9"]) == 2
    err = capsys.readouterr().err
    assert "tpu-v9" in err and all(name in err for name in H.PRESETS)


def test_bad_setting_exits_2(capsys):
    assert main(["plan", "default", "GPU_MEM=2", "--hardware", "gb10"]) == 2


def test_human_output_names_the_pool(capsys):
    assert main(["plan", "native", "--hardware", "gb10"]) == 0
    out = capsys.readouterr().out
    assert "KV pool" in out and "page cache" in out
    # the assumptions as a list, one per line, citing nothing outside the repository
    listed = out.split("  assumptions:\n", 1)[1].splitlines()
    assert len(listed) >= 5 and all(line.startswith("    - ") and len(line) < 400 for line in listed)
    assert "geometry of the published checkpoint" in out and ".md §" not in out and "shared/" not in out


def test_monotonic_in_gpu_mem():
    toks = [plan(GPU_MEM=g, CTX=500000, YARN=1, MODE="hybrid")["kv_cache_tokens"] for g in (0.7, 0.75, 0.8, 0.85)]
    assert toks == sorted(toks) and len(set(toks)) == 4


def test_fp8_kv_about_1_9x():
    bf16 = plan(CTX=1000000, YARN=1, MODE="hybrid")["kv_cache_tokens"]
    fp8 = plan(CTX=1000000, YARN=1, MODE="hybrid", KV_DTYPE="fp8_e4m3")["kv_cache_tokens"]
    assert 1.8 <= fp8 / bf16 <= 2.0


def test_mtp_adds_the_drafter_layer_and_its_weights():
    off, on = plan(MTP=0, MODE="hybrid"), plan(MTP=2, MODE="hybrid")
    assert on["kv_bytes_per_token"] - off["kv_bytes_per_token"] == 2048 + 64
    assert on["weights_gib"] > off["weights_gib"]
    assert on["kv_cache_tokens"] < off["kv_cache_tokens"]


def test_kv_cache_mem_replaces_the_budget():
    p = plan(KV_CACHE_MEM="10G", MODE="hybrid")
    assert p["kv_cache_gib"] == 10.0 and p["budget"]["kv_cache_mem_set"]
    assert p["kv_cache_tokens_range"][0] == p["kv_cache_tokens_range"][1]
    assert plan(KV_CACHE_MEM="20G", MODE="hybrid")["kv_cache_tokens"] > p["kv_cache_tokens"]


def test_more_batched_tokens_less_kv():
    assert plan(BATCHED_TOKENS=16384)["kv_cache_tokens"] < plan(BATCHED_TOKENS=4096)["kv_cache_tokens"]


def levels(findings):
    return [level for level, _ in findings]


def test_doctor_refuses_what_cannot_fit():
    s = resolve(None, None, {"GPU_MEM": "0.6"})
    found = doctor_findings(s, GB10)
    assert "fail" in levels(found) and any("cannot fit" in t for _, t in found)
    s = resolve(None, None, {"GPU_MEM": "0.7", "CTX": "1048576", "YARN": "1"})
    assert any("one CTX=1048576 request" in t for lvl, t in doctor_findings(s, GB10) if lvl == "fail")


def test_doctor_warns_when_page_cache_is_thin_and_fails_on_swap():
    thin = doctor_findings(resolve(None, None, {"GPU_MEM": "0.88"}), GB10)
    assert any(lvl == "warn" and "page cache" in t for lvl, t in thin) and "fail" not in levels(thin)
    swap = doctor_findings(resolve(None, None, {"GPU_MEM": "0.95"}), GB10)
    assert any(lvl == "fail" and "swap" in t for lvl, t in swap)
    ok = doctor_findings(resolve(None, None, {"GPU_MEM": "0.8"}), GB10)
    assert levels(ok)[-1] == "ok"


def test_doctor_fails_when_memory_is_not_available_now():
    hw, _ = H.detect(meminfo={"MemTotal": 128_501_256_192, "MemAvailable": 80 * 1024**3},
                     gpus=[("NVIDIA GB10", "[N/A]", "12.1")], probe=False)
    found = build(resolve(None, None, {}), hw, snapshot=None)["findings"]
    assert any(lvl == "fail" and "available now" in t for lvl, t in found)
    # doctor runs this check itself in its host section: not twice
    assert not any("available now" in t for _, t in doctor_findings(resolve(None, None, {}), hw))


def test_status_comparison_reports_the_error():
    s = resolve(None, None, {"MODE": "hybrid", "CTX": "500000", "YARN": "1"})
    predicted = build(s, GB10, snapshot=None)["kv_cache_tokens"]
    line = "(EngineCore pid=7) INFO 09-14 kv_cache_utils.py:2033] GPU KV cache size: 650,000 tokens, Maximum concurrency ..."
    text = status_comparison(s, line, GB10)
    assert "measured 650,000" in text and f"predicted {predicted:,}" in text
    assert f"{(predicted - 650_000) / 650_000 * 100:+.1f}%" in text
    assert "no 'GPU KV cache size' line" in status_comparison(s, "", GB10)


def test_detection_gb10_from_meminfo(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       125489508 kB\nMemFree:        1000 kB\nMemAvailable:   100000000 kB\n")
    info = H.read_meminfo(p)
    hw, how = H.detect(meminfo=info, gpus=[("NVIDIA GB10", "[N/A]", "12.1")], probe=False)
    assert hw.name == "gb10" and hw.detected and hw.host_total == 125489508 * 1024
    assert hw.host_available == 100000000 * 1024 and "GB10" in how


def test_detection_discrete_and_none():
    hw, _ = H.detect(meminfo={"MemTotal": 2 * 1024**4}, gpus=[("NVIDIA H200", "143771", "9.0")], probe=False)
    assert hw.name == "h200" and not hw.unified and hw.host_total == 2 * 1024**4
    hw, how = H.detect(meminfo={}, gpus=None, probe=False)
    assert hw.name == "gb10" and not hw.detected and "--hardware" in how
    # an H100: nvidia-smi's 81,559 MiB is matched to the preset, whose total is what vLLM sees
    # (79.18 GiB; gpu-e2e run46's kv_plan_oos planned from nvidia-smi's figure and came 0.06 GiB high)
    hw, _ = H.detect(meminfo={"MemTotal": 1024**4}, gpus=[("NVIDIA H100 80GB HBM3", "81559", "9.0")], probe=False)
    assert hw.name == "h100" and hw.device_total == int(79.18 * H.GIB) < 81559 * 1024**2


def test_planned_from_headers_when_the_snapshot_is_there(tmp_path, monkeypatch):
    from test_plan_weights import make_snapshot

    repo = tmp_path / "hf" / "hub" / "models--nvidia--Qwen3.8-Flash-Next-NVFP4"
    commit = "a" * 40
    (repo / "snapshots").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snap = make_snapshot(repo / "snapshots")
    snap.rename(repo / "snapshots" / commit)
    s = resolve(None, None, {"HF_CACHE": str(tmp_path / "hf"), "MODE": "nvfp4"})
    p = build(s, GB10)
    assert p["weights"]["source"] == f"headers:{repo / 'snapshots' / commit}"
    # the synthetic checkpoint is tiny: what is left is the 320 MiB draft-head slice vLLM allocates, outside
    # the budget (it books it after its profile's peak)
    assert p["weights_gib"] == pytest.approx(0.0, abs=0.001)
    assert p["budget"]["draft_head_outside_gib"] == pytest.approx(0.3125, abs=0.001)


# --- the H200 and tiny test checkpoints (issue 11: plan vs the KV pool a real H200 boot logs) ---

TINY_TEXT = {"model_type": "qwen4_exp_text", "hidden_size": 256, "num_hidden_layers": 8, "vocab_size": 1024,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "indexer_n_heads": 2,
             "indexer_head_dim": 64, "indexer_budget": 512, "indexer_compress_ratio": 32,
             "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
             "linear_value_head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
             "shared_expert_intermediate_size": 128, "hc_count": 2, "hc_lowrank": 32, "ple_embed_dim": 256,
             "mtp_num_hidden_layers": 1,
             "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2}


def tiny_dir(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForConditionalGeneration"],
                                               "text_config": TINY_TEXT}))
    return d


def test_h200_preset_is_discrete_with_cudamemgetinfo_total():
    h = H.PRESETS["h200"]
    assert not h.unified and 139 * H.GIB < h.device_total < 143 * H.GIB
    assert h.flashinfer_gdn  # SM90: 0.33 picks FlashInfer GDN prefill on auto


def test_plan_h200_tiny_config_dir_with_gpu_mem_and_extra(tmp_path, capsys):
    d = tiny_dir(tmp_path)
    extra = "--block-size 256 --gdn-prefill-backend triton"
    for path in (d, d / "config.json"):  # a checkpoint dir or its config.json
        rc, obj = run_json(capsys, "default", "GPU_MEM=0.9", "CTX=2048", "MTP=0", f"EXTRA={extra}",
                           "--hardware", "h200", "--config", str(path))
        assert rc == 0, obj["findings"]
        assert obj["hardware"]["name"] == "h200" and obj["hardware"]["unified_memory"] is False
        b = obj["budget"]
        assert b["gpu_mem"] == 0.9
        assert b["requested_gib"] == pytest.approx(0.9 * H.PRESETS["h200"].device_total / H.GIB, abs=0.01)
        lay = obj["kv_layout"]
        # vLLM: alignment = max(kernel 16, --block-size); block = alignment × ⌈mamba page / (alignment × attn/token)⌉
        need = -(-lay["mamba_page_bytes"] // (256 * lay["attention_page_bytes_per_token"]))
        assert lay["block_size"] == 256 * need, "EXTRA's --block-size is the alignment"
        text = " | ".join(obj["assumptions"])
        assert f"geometry from {d / 'config.json'}" in text
        assert "discrete GPU" in text and "page cache is host RAM" in text
        assert "--block-size 256" in text and "--gdn-prefill-backend triton" in text
        assert "139.81 GiB × GPU_MEM 0.9" in text
        # the plan was made from the tiny geometry, not the published one (which has 12 QSA layers)
        assert sum(1 for g in obj["kv_layout"]["caches"] if "qsa" in json.dumps(g)) >= 1
        assert obj["kv_bytes_per_token"] < build(resolve(None, None, {"CTX": "2048", "MTP": "0"}),
                                                 H.PRESETS["h200"], snapshot=None)["kv_bytes_per_token"]
        assert obj["kv_cache_tokens"] > 0 and obj["host"]["unified_memory"] is False


def test_plan_without_block_size_follows_vllm_alignment(tmp_path):
    from flash_cli.plan import extra_block_size, flashinfer_gdn

    assert extra_block_size("--block-size 256") == 256 and extra_block_size("--block-size=64 -O3") == 64
    assert extra_block_size("--enforce-eager") is None and extra_block_size("--block-size x") is None
    h200 = H.PRESETS["h200"]
    assert flashinfer_gdn("--gdn-prefill-backend triton", h200) == (False, "triton")
    assert flashinfer_gdn("", h200) == (True, None)
    assert flashinfer_gdn("--gdn-prefill-backend=flashinfer", H.PRESETS["gb10"])[0] is True
    s = resolve(None, None, {"GPU_MEM": "0.9", "CTX": "2048", "MTP": "0", "BASE": "v0.33", "PREFIX_CACHE": "1",
                             "EXTRA": "--block-size 256"})
    fi = build(s, h200, snapshot=tiny_dir(tmp_path))
    s2 = resolve(None, None, {"GPU_MEM": "0.9", "CTX": "2048", "MTP": "0", "BASE": "v0.33", "PREFIX_CACHE": "1",
                              "EXTRA": "--block-size 96"})
    assert build(s2, h200, snapshot=tmp_path / "tiny")["kv_layout"]["block_size"] % 96 == 0
    assert fi["kv_layout"]["block_size"] % 256 == 0


def test_plan_config_that_is_not_there_exits_2(tmp_path, capsys):
    assert main(["plan", "--hardware", "h200", "--config", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_plan_refuses_a_block_the_qsa_ring_does_not_divide(tmp_path, capsys):
    d = tmp_path / "odd"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"text_config": {**TINY_TEXT, "indexer_compress_ratio": 100}}))
    assert main(["plan", "GPU_MEM=0.9", "CTX=2048", "MTP=0", "--hardware", "h200", "--config", str(d)]) == 2
    err = capsys.readouterr().err
    assert "ring capacity 100 does not divide" in err and "multiple of 400" in err


@pytest.mark.parametrize("over, full", [({}, True), ({"BASE": "v0.30"}, True), ({"BASE": "v0.29"}, False),
                                        ({"PLE_MODE": "eager"}, False)])
def test_full_graph_regime_is_a_named_assumption(over, full):
    # the unified-memory fit was measured under PIECEWISE; the hoisted default's FULL graphs are said to be outside it
    text = " | ".join(build(resolve(None, None, over), H.PRESETS["gb10"], snapshot=None)["assumptions"])
    assert ("graphs FULL_AND_PIECEWISE" in text) is full and ("PIECEWISE graphs" in text) is full
    # on a discrete card each regime has its own fit (run37: eager, PIECEWISE; run43: hoisted, FULL) and says which
    plan = build(resolve(None, None, over), H.PRESETS["h200"], snapshot=None)
    text = " | ".join(plan["assumptions"])
    assert ("gpu-e2e-h200/run43" in text and "hoisted gather, FULL_AND_PIECEWISE" in text) is full
    assert ("gpu-e2e-h200/run37" in text and "eager gather, PIECEWISE" in text) is not full
    # the published geometry is the real model's layers: the real-shape term comes on top of the regime's
    from flash_cli.plan import calibration as cal

    regime = cal.RUNTIME_OVERHEAD_DISCRETE_FULL if full else cal.RUNTIME_OVERHEAD_DISCRETE
    assert plan["budget"]["runtime_overhead_gib"] == round((regime + cal.RUNTIME_SHAPE_EXTRA) / 1024**3, 3)
