"""lab/bench_recipe.py: every server is the RunSpec `flash serve` renders, changed only where the
bench says so; the blocks run against a stand-in `vllm` module (real HTTP, streamed completions,
Prometheus counters) and the report pairs each config with stock in the same cycle."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from flash_cli import compile_config, recipe
from flash_cli.commands import serve

from lab import bench_recipe as br
from lab.decode import recipe_report
from tests.fakes import vllm_cli


# the flags the bench substitutes in a RunSpec's argv (docstring: each one said in `deviations`)
SUBSTITUTED = {"--load-format", "--host", "--port", "--served-model-name"}


def _pairs(argv: list[str]) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            val = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out[argv[i]] = val
            i += 2 if val is not None else 1
        else:
            i += 1
    return out


@pytest.mark.parametrize("name", list(br.CONFIGS))
def test_flash_servers_are_the_runspec_with_only_the_said_substitutions(name, tmp_path):
    c = br.CONFIGS[name]
    r = recipe.load([c["profile"], *c["words"]], env={})
    spec = serve.plan(r, "<SNAPSHOT>")
    got = br.render(name, tmp_path, 18999, "py")
    want, have = _pairs(list(spec.command[3:])), _pairs(got["argv"])
    for flag, val in want.items():
        if flag not in SUBSTITUTED:
            assert have.get(flag, "<absent>") == val, (name, flag)
    assert have["--load-format"] == "dummy" and have["--port"] == "18999" and have["--host"] == "127.0.0.1"
    extra = set(have) - set(want)
    allowed = {"--gdn-prefill-backend"} | ({"--engram-config"} if c["kind"] == "stock" else set())
    assert extra == allowed, extra
    # the container environment, less the HF cache mount, plus what the bench says
    for k, v in spec.env.items():
        if k != "HF_HOME":
            assert got["env"][k] == v or k == "VLLM_USE_FLASHINFER_SAMPLER", k
    model = got["argv"][got["argv"].index("serve") + 1]
    assert model == str(tmp_path / ("model-hybrid" if r.settings["MODE"] == "hybrid" else "model"))
    if c["kind"] == "stock":
        assert got["env"]["VLLM_PLUGINS"] == "" and "flash_vllm.launch" not in got["argv"]
        assert have["--engram-config"] == '{"cpu_offload":false}'
    else:
        assert "VLLM_PLUGINS" not in got["env"] and got["argv"][:3] == ["py", "-m", "flash_vllm.launch"]
        assert got["env"]["VLLM_PLE_MMAP_DIR"] == str(tmp_path / "ple")


def test_ablations_change_only_their_setting():
    d = Path("/x")
    base = br.render("default", d, 1)
    # DRAFT_VOCAB=0: the variable is not set at all (patch 10's gate off); DET_TOPK=0: the stock kernel
    for name, changed in (("default-no10", {"VLLM_MTP_DRAFT_VOCAB": None}), ("default-no8", {"VLLM_QSA_DET_TOPK": "0"}),
                          ("default-deepgemm", {"VLLM_USE_DEEP_GEMM": "1", "VLLM_DEEP_GEMM_WARMUP": "skip"})):
        got = br.render(name, d, 1)
        assert got["argv"] == base["argv"]
        keys = set(got["env"]) | set(base["env"])
        assert {k for k in keys if got["env"].get(k) != base["env"].get(k)} == set(changed)
        assert {k: got["env"].get(k) for k in changed} == changed
    mtp4 = _pairs(br.render("default-mtp4", d, 1)["argv"])
    assert json.loads(mtp4["--speculative-config"])["num_speculative_tokens"] == 4
    # shared's variants: GRAPH_TOKENS keeps shared's graph mode and only sets the capture size
    shared = _pairs(br.render("shared", d, 1)["argv"])
    for name, flag, want in (("shared-nographs", "--compilation-config", '{"cudagraph_mode":"FULL_AND_PIECEWISE"}'),
                             ("shared-3200", "--long-prefill-token-threshold", "3200")):
        got = _pairs(br.render(name, d, 1)["argv"])
        assert {k for k in set(got) | set(shared) if got.get(k) != shared.get(k)} == {flag}
        assert got[flag] == want
    assert br.render("shared-graphs", d, 1)["argv"] == br.render("shared", d, 1)["argv"]  # latency48 run2's argv
    cc = compile_config.compilation_config(br.render("shared", d, 1)["argv"])
    assert cc == {"cudagraph_mode": "FULL_AND_PIECEWISE", "max_cudagraph_capture_size": 832}
    assert "--speculative-config" not in _pairs(br.render("shared-nomtp", d, 1)["argv"])
    # the piece sweep: threshold and capture size change together, each piece divides the block and
    # flash plan puts the piece beside every stream inside the graphs, on the smallest size that does
    from flash_cli import profiles
    from flash_cli.plan import prefill
    from flash_cli.settings import resolve

    for piece in (100, 200, 400):
        name = f"shared-{piece}"
        got = _pairs(br.render(name, d, 1)["argv"])
        assert {k for k in set(got) | set(shared) if got.get(k) != shared.get(k)} == \
            {"--long-prefill-token-threshold", "--compilation-config"}
        s = resolve(profiles.load("shared").layer(), {}, dict(w.split("=", 1) for w in br.CONFIGS[name]["words"]),
                    profile_name="shared")
        p = prefill.plan(s, 1600)
        assert p["pieces_per_block"] == [piece] * (1600 // piece) and p["in_graphs"]
        assert s["GRAPH_TOKENS"] == prefill.grid_up(p["step_beside_tokens"])
        assert json.loads(got["--compilation-config"])["max_cudagraph_capture_size"] == s["GRAPH_TOKENS"]


# NVIDIA's recipe.yaml as published (NVIDIA/local-ai-inference-recipes @dedcf6bc, the one-Spark
# nvfp4 recipe's `serve` block): the reference the `nvidia` profile is checked against
RECIPE_ENV = {"VLLM_PLE_TABLE_MEMORY": "disk", "CUTE_DSL_ARCH": "sm_121a", "SAFETENSORS_FAST_GPU": "1",
              "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_SSM_CONV_STATE_LAYOUT": "DS", "VLLM_USE_AOT_COMPILE": "1",
              "VLLM_USE_MEGA_AOT_ARTIFACT": "1", "VLLM_USE_V2_MODEL_RUNNER": "1", "B12X_POLICY_MODE": "auto",
              "VLLM_MXFP8_LM_HEAD": "1", "VLLM_B12X_MOE_FP4_LAYER_MAX_INPUT_SCALE": "w13"}
RECIPE_ARGS = ["--host", "0.0.0.0", "--port", "8000", "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
               "--mamba-cache-mode", "align", "--enable-prefix-caching", "--enable-chunked-prefill", "--dtype", "bfloat16",
               "--kv-cache-dtype", "fp8", "--quantization", "modelopt_mixed", "--block-size", "16", "--load-format", "b12x",
               "--max-model-len", "262144", "--max-num-seqs", "8", "--max-num-batched-tokens", "4096",
               "--speculative-config", '{"method":"mtp","num_speculative_tokens":4}',
               "--gdn-decode-kernel", "b12x", "--linear-backend", "b12x", "--moe-backend", "b12x",
               "--no-enable-flashinfer-autotune", "--mm-encoder-tp-mode", "data", "--reasoning-parser", "qwen3",
               "--tool-call-parser", "qwen3_xml", "--enable-auto-tool-choice",
               "--compilation-config", '{"pass_config":{"fuse_act_quant":true}}', "--gpu-memory-utilization", "0.8"]
# where our rendering differs from the recipe by design, not by a missing B12x feature
BY_DESIGN = {"--host", "--port"}  # flash's BIND/PORT; the bench's own loopback port
VLLM_DEFAULT = {"--tensor-parallel-size 1", "--pipeline-parallel-size 1"}


@pytest.mark.parametrize("name", ["nvidia", "nvidia-flash"])
def test_nvidia_profile_renders_every_recipe_item_our_base_takes_and_names_the_rest(name):
    got = br.render(name, Path("/x"), 1)
    have = _pairs(got["argv"])
    for flag, val in _pairs(RECIPE_ARGS).items():
        word = f"{flag} {val}" if val is not None else flag
        if word in br.NVIDIA_DROPPED:
            assert flag not in have or flag == "--load-format", word
            if name == "nvidia":
                assert any(d.startswith(f"dropped {word}:") for d in got["deviations"])
        elif flag == "--speculative-config":
            assert json.loads(have[flag]) == json.loads(val)
        elif flag == "--compilation-config":  # theirs plus the graph mode our PLE gather needs
            assert json.loads(have[flag])["pass_config"] == json.loads(val)["pass_config"]
        elif flag == "--gpu-memory-utilization":
            assert float(have[flag]) == float(val)
        elif flag not in BY_DESIGN and word not in VLLM_DEFAULT:
            assert have.get(flag, "<absent>") == val, flag
    for k, v in RECIPE_ENV.items():
        assert got["env"].get(k) == v or f"{k}={v}" in br.NVIDIA_DROPPED, k
    # every dropped item is one of the recipe's, spelled as the recipe spells it
    words = {f"{f} {v}" if v is not None else f for f, v in _pairs(RECIPE_ARGS).items()}
    assert set(br.NVIDIA_DROPPED) <= words | {f"{k}={v}" for k, v in RECIPE_ENV.items()}
    assert (got["env"].get("VLLM_PLUGINS") == "") == (name == "nvidia")


def test_the_dropped_list_is_read_from_the_profile_and_refused_when_missing(tmp_path):
    assert "--load-format b12x" in br.NVIDIA_DROPPED and "VLLM_PLE_TABLE_MEMORY=disk" in br.NVIDIA_DROPPED
    bare = tmp_path / "nvidia.env"
    bare.write_text("MODE=nvfp4\n# desc: x\n")
    with pytest.raises(SystemExit, match="b12x"):
        br.nvidia_dropped(bare)


def test_a_bad_config_list_is_refused_naming_it():
    with pytest.raises(SystemExit, match="defualt"):
        br._configs("stock,defualt")
    with pytest.raises(SystemExit):
        br._configs("stock,stock")


def test_hybrid_model_dir_passes_flash_s_own_gate(tmp_path):
    assert br.main(["prepare", str(tmp_path), "--ple-rows", "100000"]) == 0
    from flash_cli.checkpoint import quantcfg

    cfg = json.loads((tmp_path / "model-hybrid" / "config.json").read_text())
    hq = json.loads((tmp_path / "model-hybrid" / "hf_quant_config.json").read_text())
    assert quantcfg.problems(cfg, hq, br.side_modules(48)) == []
    # the published dir keeps its side layers unquantized (excluded), the hybrid serves them as fp8
    pub = json.loads((tmp_path / "model" / "config.json").read_text())["quantization_config"]
    assert all(m not in pub["quantized_layers"] for m in br.side_modules(48))
    assert (tmp_path / "model-hybrid" / "tokenizer.json").resolve() == (tmp_path / "model" / "tokenizer.json").resolve()


def test_fewer_layers_keep_the_shapes_and_the_gate(tmp_path):
    """The H100 fallback (36 layers): the same per-layer shapes, the hybrid gate on those layers."""
    assert br.main(["prepare", str(tmp_path), "--ple-rows", "100000", "--layers", "36"]) == 0
    from flash_cli.checkpoint import quantcfg

    meta = json.loads((tmp_path / "meta.json").read_text())
    cfg = json.loads((tmp_path / "model-hybrid" / "config.json").read_text())
    hq = json.loads((tmp_path / "model-hybrid" / "hf_quant_config.json").read_text())
    assert meta["layers"] == 36 and cfg["text_config"]["num_hidden_layers"] == 36
    assert quantcfg.problems(cfg, hq, br.side_modules(36)) == []
    assert not any(".layers.36." in m for m in json.dumps(hq).split('"'))
    with pytest.raises(SystemExit, match="--layers 30"):
        br.main(["prepare", str(tmp_path / "x"), "--ple-rows", "100000", "--layers", "30"])


def test_a_set_goes_to_every_server_and_is_named():
    sets = ("GPU_MEM=0.93",)
    for name in ("stock", "default", "default-nvfp4"):
        got = br.render(name, Path("/x"), 1, sets=sets)
        argv = _pairs(got["argv"])
        assert argv["--gpu-memory-utilization"] == "0.93" and got["settings"]["GPU_MEM"] == "0.93"
        assert "GPU_MEM=0.93: set for every server of this run (--set)" in got["deviations"]
        plain = br.render(name, Path("/x"), 1)
        assert {k: v for k, v in argv.items() if k != "--gpu-memory-utilization"} == \
            {k: v for k, v in _pairs(plain["argv"]).items() if k != "--gpu-memory-utilization"}
    # the ablation's own words still apply under a --set
    assert br.render("default-nvfp4", Path("/x"), 1, sets=sets)["settings"]["MODE"] == "nvfp4"


FAKE_MAIN = r'''
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
assert argv[0] == "serve", argv
port = int(argv[argv.index("--port") + 1])
plugin = os.environ.get("VLLM_PLUGINS") != ""
mtp = json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"]
delay = 0.002 if not plugin else 0.0019
drafts = [0]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        text = ("vllm:spec_decode_num_drafts_total{model_name=\"bench\"} %d\n"
                "vllm:spec_decode_num_accepted_tokens_total{model_name=\"bench\"} 0\n" % drafts[0])
        body = b"ok" if self.path == "/health" else text.encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["model"] == "bench" and isinstance(req["prompt"], list) and req["ignore_eos"]
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        time.sleep(len(req["prompt"]) * 1e-6)
        for i in range(req["max_tokens"]):
            time.sleep(delay)
            drafts[0] += 1
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n")
        self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": req["max_tokens"]}}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
print("INFO Using MoE backend FAKE", flush=True)
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_blocks_alternate_whole_servers_and_pair_within_a_cycle(tmp_path, monkeypatch):
    vllm_cli.install(tmp_path, monkeypatch, FAKE_MAIN)
    d = tmp_path / "b"
    assert br.main(["prepare", str(d), "--ple-rows", "100000"]) == 0
    out = tmp_path / "raw.jsonl"
    rc = br.main(["run", str(d), "--configs", "stock,default", "--out", str(out), "--levels", "1,2",
                  "--long-levels", "1", "--long-prompt", "300", "--tokens", "16", "--repeats", "2",
                  "--warmup-tokens", "4", "--deadline", "600", "--cycles", "2", "--boot-guess", "5", "--block-guess", "5",
                  "--port", "18790", "--set", "GPU_MEM=0.7"])
    assert rc == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    booted = [r for r in rows if r.get("event") == "booted"]
    # whole servers in blocks, one at a time, the order reversed every other cycle (A B B A); the
    # server that ends cycle 0 is kept for the block that starts cycle 1: three boots for four blocks
    assert [r["label"] for r in booted] == ["stock", "default", "stock"]
    kept = [r for r in rows if r.get("event") == "kept"]
    assert [(r["label"], r["cycle"], r["log"]) for r in kept] == [("default", 1, "default-c0.log")]
    blocks = [(r["label"], r["cycle"]) for r in rows if r.get("per_stream_tok_s") and r.get("round") == 0
              and r["concurrency"] == 1 and r["prompt_tokens"] == 64]
    assert blocks == [("stock", 0), ("default", 0), ("default", 1), ("stock", 1)]
    assert all(r["commit"] and r["deviations"] and r["layers"] == 48 for r in booted)
    # each booted row names the words it was rendered from and its log (lab.plan_vs_boots --raw plans it)
    assert [(r["words"], r["log"]) for r in booted] == [
        (["published", "GPU_MEM=0.7"], "stock-c0.log"), (["default", "GPU_MEM=0.7"], "default-c0.log"),
        (["published", "GPU_MEM=0.7"], "stock-c1.log")]
    assert all(float(_pairs(r["argv"])["--gpu-memory-utilization"]) == 0.7 and "gpu" in r for r in booted)
    assert any("MoE backend" in ln for ln in booted[0]["log_lines"])
    # each server log names the commit it measured and the argv it ran, before the server's own lines
    head = (tmp_path / "stock-c0.log").read_text().splitlines()
    assert head[0].startswith(f"# flash lab server log: commit {booted[0]['commit']}, started 20")
    assert head[1] == "# argv: " + shlex.join(booted[0]["argv"]) and "MoE backend" in "\n".join(head[2:])
    meas = [r for r in rows if r.get("per_stream_tok_s")]
    cells = {(r["concurrency"], r["prompt_tokens"]) for r in meas}
    assert cells == {(1, 64), (2, 64), (1, 300)}
    # the same prompts in the same order for both configs of a cycle: pairs are complete per cycle
    rep = recipe_report.report(rows)
    stock_vs = rep["vs_stock"]["default"]
    assert stock_vs["pooled"]["pairs"] >= 6 and set(stock_vs) >= {"pooled", "c=1 p=64", "c=2 p=64", "c=1 p=300"}
    assert stock_vs["pooled"]["verdict"] in ("met", "open", "missed") and "ci95" in stock_vs["pooled"]
    assert rows[-1]["event"] == "end" and rows[-1]["cycles"] == 2


def test_step_breakdown_reads_steps_and_patch_1s_phases_from_the_rows():
    ple = {"gather_ms_per_op": 0.05, "stage_ms_per_op": 0.03, "dedup_ms_per_op": 0.01, "gpu_wait_ms_per_op": 8.0,
           "rows_per_op": 206.4}
    rows = [{"label": "default", "concurrency": 4, "prompt_tokens": 64, "per_stream_tok_s": s,
             "mtp_acceptance_length": 1.0, "ple": ple} for s in (50.0, 100.0, 40.0)]
    rows += [{"label": "stock", "concurrency": 4, "prompt_tokens": 64, "per_stream_tok_s": 200.0,
              "mtp_acceptance_length": 2.0},  # two tokens a step: a 10 ms step
             {"label": "stock", "event": "booted", "boot_s": 99.0}]
    out = recipe_report.step_breakdown(rows)
    cell = recipe_report.cell(rows[0])
    assert out["default"][cell] == {"step": 20.0, "ple_host": 0.09, "ple_gpu_wait": 8.0, "ple_rows": 206.4}
    assert out["stock"][cell] == {"step": 10.0, "ple_host": None, "ple_gpu_wait": None, "ple_rows": None}


def test_report_pairs_the_ablations_with_default_and_leaves_stock_out_of_that_table():
    rows = [{"label": lab, "concurrency": 4, "prompt_tokens": 64, "repeat": rep, "per_stream_tok_s": v}
            for rep in (0, 1) for lab, v in (("stock", 70.0), ("default", 68.0), ("default-ple-gpu", 71.4))]
    rep = recipe_report.report(rows)
    assert set(rep["vs_default"]) == {"default-ple-gpu"}  # neither stock nor default itself
    assert rep["vs_default"]["default-ple-gpu"]["pooled"]["geomean"] == round(71.4 / 68.0, 3)
    assert rep["vs_stock"]["default"]["pooled"]["geomean"] == round(68.0 / 70.0, 3)


def test_report_pairs_time_to_first_token_the_same_way_slower_above_one():
    rows = [{"label": lab, "concurrency": 4, "prompt_tokens": 6144, "repeat": rep, "per_stream_tok_s": 70.0,
             "ttft_s": t * (1 + rep / 50)}
            for rep in (0, 1, 2) for lab, t in (("stock", 0.9), ("default", 1.08), ("default-ple-gpu", 0.99))]
    rows += [{"label": "default", "concurrency": 4, "prompt_tokens": 64, "repeat": 0, "per_stream_tok_s": 90.0},
             {"label": "stock", "concurrency": 4, "prompt_tokens": 64, "repeat": 0, "per_stream_tok_s": 88.0, "ttft_s": 0.3}]
    rep = recipe_report.report(rows)
    cell = "c=4 p=6144"
    assert rep["ttft_ms_median"]["default"][cell] == round(1080 * 1.02, 1)
    assert rep["ttft_vs_stock"]["default"][cell]["geomean"] == 1.2  # 20% slower than stock
    lo, hi = rep["ttft_vs_stock"]["default"][cell]["ci95"]
    assert lo <= 1.2 <= hi and "verdict" not in rep["ttft_vs_stock"]["default"][cell]
    assert set(rep["ttft_vs_default"]) == {"default-ple-gpu"}  # the ablation against the recipe, stock left out
    assert rep["ttft_vs_default"]["default-ple-gpu"][cell]["geomean"] == round(0.99 / 1.08, 3)
    # a row without a TTFT pairs nothing there, and still pairs its tok/s
    assert "c=4 p=64" not in rep["ttft_vs_stock"]["default"] and "c=4 p=64" in rep["vs_stock"]["default"]


def test_report_command_writes_the_json_and_a_plot_with_the_intervals(tmp_path, capsys):
    rows = [{"label": lab, "concurrency": c, "prompt_tokens": 64, "repeat": rep, "per_stream_tok_s": v * (1 + rep / 100)}
            for rep in (0, 1, 2) for c in (1, 4) for lab, v in (("stock", 70.0), ("default", 72.0))]
    rows.append({"event": "booted", "label": "stock", "layers": 32, "gpu": "NVIDIA H100 80GB HBM3", "boot_s": 1.0})
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png, js = tmp_path / "r.png", tmp_path / "r.json"
    assert br.main(["report", str(raw), "--out", str(png), "--json", str(js)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rep = json.loads(js.read_text())
    assert rep == recipe_report.report([r | {"run": 0} for r in rows])
    assert rep["vs_stock"]["default"]["pooled"]["geomean"] == round(72.0 / 70.0, 3)
    assert rep["vs_stock"]["default"]["pooled"]["ci95"][0] <= rep["vs_stock"]["default"]["pooled"]["geomean"]


def test_a_configs_next_boot_is_not_estimated_by_the_sessions_cold_first_boot():
    # run5 (2026-12-06): stock booted first, cold (396.5 s), the others warm (126-170 s); with 198 s
    # left, stock's second block was skipped on its cold figure (need 458) though a warm boot fits
    boots = [("stock", 396.5), ("default", 170.2), ("default-nvfp4", 126.1), ("default", 144.1)]
    assert br.boot_estimate(boots, "stock", 300) == 170.2  # the slowest warm boot
    assert br.boot_estimate(boots, "default", 300) == 144.1  # its own last boot
    assert br.boot_estimate(boots, "default-ple-gpu", 300) == 300  # never booted: the guess
    # a config that booted first and again since: its own warm figure
    assert br.boot_estimate(boots + [("stock", 120.0)], "stock", 300) == 120.0
    # the first boot alone: nothing warm to go by, its own figure
    assert br.boot_estimate([("stock", 396.5)], "stock", 300) == 396.5
    assert br.boot_estimate([], "stock", 300) == 300


def test_a_cycle_that_cannot_finish_runs_its_reference_before_any_block_that_needs_a_boot():
    # run8 (2026-12-07): cycle 1 was speed (kept), default-mtp4, stock; stock, last, was skipped with
    # 203 s left, so neither block of that cycle paired with anything against stock
    need = {"speed": 95.0, "default-mtp4": 243.0, "stock": 267.0}
    todo = ["speed", "default-mtp4", "stock"]
    assert br.reference(todo) == "stock" and br.reference(["default", "default-no8"]) == "default"
    assert br.reference(["speed", "default-mtp4"]) is None
    assert br.next_block(todo, need, 700.0, "stock", kept="speed") == "speed"   # the whole cycle fits: its order
    assert br.next_block(todo, need, 540.0, "stock", kept="speed") == "speed"   # kept, and stock fits after it
    assert br.next_block(todo[1:], need, 445.0, "stock", kept="speed") == "stock"  # next: stock before a boot
    assert br.next_block(todo, need, 300.0, "stock", kept="speed") == "stock"   # kept + stock do not fit
    assert br.next_block(todo, need, 540.0, "stock") == "stock"                 # nothing kept
    assert br.next_block(["speed", "default-mtp4"], need, 10.0, None) == "speed"  # no reference: the order
    assert br.next_block(["stock", "speed"], need, 10.0, "stock") == "stock"
