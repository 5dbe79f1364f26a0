"""lab/bench_profile.py and lab/decode/trace.py (issue 33's open "why"s: where a mixed step's fixed
cost goes). The reader is checked on traces built event by event in Kineto's schema (a graph's
kernels carrying its launch's correlation, Triton's driver launches, an unlinked kernel, a copy);
the bench against a stand-in `vllm` module that serves real HTTP, runs one engine loop (a long
prompt in pieces beside a stream), answers /start_profile and /stop_profile as vLLM 0.32+ does
(a prefix, a step bound, the worker stopping itself) and writes each profile as a gzipped Chrome
trace of the steps it really ran. The trace format itself, as vLLM's own wrapper writes it, is
checked in the vllm tier (tests/vllm/release/check_bench_profile.py)."""

from __future__ import annotations

import gzip
import json

import pytest

from lab import bench_profile as bp
from lab import bench_recipe as br
from lab.decode import trace
from tests.fakes import vllm_cli


def _ann(name, ts, dur, tid=11):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 100, "tid": tid, "ts": ts, "dur": dur}


def _rt(name, ts, corr, dur=5.0, cat="cuda_runtime", tid=11):
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _gpu(name, ts, dur, corr, cat="kernel", stream=7):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0}}


DEC = "execute_context_0(0)_generation_1(3)"
MIX = "execute_context_1(25)_generation_1(3)"


def synthetic() -> list[dict]:
    """Two decode steps (one graph of two kernels each) and two mixed steps (a graph, 3 eager
    launches of a GDN prefill kernel, one Triton launch through the driver, a blocking sync, a
    copy, and one kernel no launch claims), 10 ms and 40 ms apart; a flow event and metadata."""
    ev = [{"ph": "M", "name": "process_name", "pid": 100, "args": {"name": "worker"}},
          {"ph": "s", "cat": "ac2g", "id": 1, "pid": 100, "tid": 11, "ts": 0}]
    t, corr = 1000.0, 1
    for i, name in enumerate((DEC, DEC, MIX, MIX)):
        ev.append(_ann(name, t, 2000.0))
        # vLLM's sections: one inside the step's annotation, one after it (sample_tokens) in its window
        ev.append(_ann("gpu_model_runner: preprocess", t + 10, 60.0 if name == DEC else 900.0))
        ev.append(_ann("gpu_model_runner: sample", t + 2100, 300.0))
        ev.append(_rt("cudaGraphLaunch", t + 100, corr, dur=20.0))
        ev.append(_gpu("fused_moe_kernel_marlin", t + 200, 3000.0, corr))
        ev.append(_gpu("nvjet_hsh_gemm", t + 3300, 2000.0, corr))
        corr += 1
        if name == MIX:
            for j in range(3):
                ev.append(_rt("cudaLaunchKernel", t + 2500 + j * 100, corr, dur=30.0))
                ev.append(_gpu("chunk_gated_delta_rule_fwd_kernel_h", t + 6000 + j * 5000, 4000.0, corr))
                corr += 1
            ev.append(_rt("cuLaunchKernel", t + 2900, corr, dur=40.0, cat="cuda_driver"))
            ev.append(_gpu("_causal_conv1d_fwd_kernel", t + 21000, 1000.0, corr))
            corr += 1
            ev.append(_rt("cudaStreamSynchronize", t + 3000, corr, dur=15000.0))
            ev.append(_rt("cudaMemcpyAsync", t + 18500, corr + 1, dur=10.0))
            ev.append(_gpu("Memcpy DtoH (Device -> Pinned)", t + 22500, 500.0, corr + 1, cat="gpu_memcpy"))
            corr += 2
            ev.append(_gpu("unclaimed_rms_norm_kernel", t + 23500, 500.0, 99999))
            # host operators: an outer one holding an inner one, then another outer one
            ev.append({"ph": "X", "cat": "cpu_op", "name": "vllm::gdn_prefill", "pid": 100, "tid": 11, "ts": t + 2400, "dur": 600.0})
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 100, "tid": 11, "ts": t + 2450, "dur": 50.0})
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 100, "tid": 11, "ts": t + 18400, "dur": 200.0})
        t += 10000.0 if name == DEC else 40000.0
    # the thread's launches before the first step belong to no step
    ev.append(_rt("cudaLaunchKernel", 10.0, 5000))
    ev.append(_gpu("warmup_kernel", 20.0, 5.0, 5000))
    return ev


def test_steps_from_a_kineto_trace(tmp_path):
    rows = trace.steps([e for e in synthetic() if e.get("ph") == "X"])
    assert [r["name"] for r in rows] == [DEC, DEC, MIX, MIX]
    d, m = rows[0], rows[2]
    assert d["period_ms"] == pytest.approx(10.0) and m["period_ms"] == pytest.approx(40.0) and rows[3]["period_ms"] is None
    assert (d["eager"], d["graphs"], d["gpu_events"], d["unlinked"]) == (0, 1, 2, 0)
    # a graph's kernels are its launch's; the busy time is the union (5.0 ms), the span 5.1
    assert d["gpu_busy_ms"] == pytest.approx(5.0) and d["gpu_span_ms"] == pytest.approx(5.1)
    assert d["by_family"] == {"moe": pytest.approx(3.0), "gemm": pytest.approx(2.0)}
    # eager launches: the runtime's and the driver's (Triton's); the sync is host time, not a launch
    assert (m["eager"], m["graphs"]) == (4, 1)
    assert m["launch_ms"] == pytest.approx((20 + 3 * 30 + 40) / 1000)
    assert m["sync_ms"] == pytest.approx(15.0)
    # the unclaimed kernel follows the GPU event before it on its stream; the copy is a family of its own
    assert (m["gpu_events"], m["unlinked"]) == (2 + 3 + 1 + 1 + 1, 1)
    assert m["by_family"]["gdn"] == pytest.approx(12.0 + 1.0) and m["by_family"]["memcpy"] == pytest.approx(0.5)
    assert m["by_kernel"]["unclaimed_rms_norm_kernel"] == pytest.approx(0.5)
    assert m["host_ops"] == {"vllm::gdn_prefill": pytest.approx(0.6), "aten::copy_": pytest.approx(0.2)} and d["host_ops"] == {}
    assert m["sections"] == {"gpu_model_runner: preprocess": pytest.approx(0.9), "gpu_model_runner: sample": pytest.approx(0.3)}
    assert m["gpu_busy_ms"] == pytest.approx(3.0 + 2.0 + 3 * 4.0 + 1.0 + 0.5 + 0.5)
    # a summary from the gzipped file: classes, their medians, what lies outside every step
    p = tmp_path / "mixed-8192_rank0.1.pt.trace.json.gz"
    with gzip.open(p, "wt") as fh:
        json.dump({"schemaVersion": 1, "traceEvents": synthetic()}, fh)
    s = trace.summarize(p)
    assert (s["steps"], s["outside"], s["unlinked"]) == (4, 1, 2)
    c = s["classes"]
    assert (c[DEC]["steps"], c[MIX]["steps"]) == (2, 2)
    assert c[DEC]["idle_ms"] == pytest.approx(5.0) and c[MIX]["idle_ms"] == pytest.approx(21.0)
    assert c[MIX]["period_ms"] == pytest.approx(40.0)  # the last step has none: the median is of the one
    assert list(c[MIX]["top_kernels"])[0] == "chunk_gated_delta_rule_fwd_kernel_h"
    dl = trace.delta(c[DEC], c[MIX])
    assert dl["figures"]["period_ms"] == pytest.approx(30.0) and dl["figures"]["eager"] == 4
    assert dl["by_family"]["gdn"] == pytest.approx(13.0) and dl["by_family"]["moe"] == pytest.approx(0.0)
    assert dl["top_host_ops"] == {"aten::copy_": pytest.approx(0.2), "vllm::gdn_prefill": pytest.approx(0.6)}
    assert dl["sections"] == {"gpu_model_runner: preprocess": pytest.approx(0.84), "gpu_model_runner: sample": 0.0}
    # the bare-list form reads the same; anything else is refused by name
    q = tmp_path / "t.json"
    q.write_text(json.dumps(synthetic()))
    assert trace.summarize(q)["classes"].keys() == c.keys()
    q.write_text(json.dumps({"nothing": 1}))
    with pytest.raises(ValueError, match="no traceEvents list"):
        trace.load(q)


def test_families_by_name():
    assert trace.family("Memcpy HtoD", "gpu_memcpy") == "memcpy"
    assert trace.family("void marlin_moe_wna16<...>") == "moe"
    assert trace.family("fused_recurrent_gated_delta_rule_fwd_kernel") == "gdn"
    assert trace.family("flash::flash_fwd_splitkv_kernel") == "attention"
    assert trace.family("qsa_indexer_logits") == "qsa"
    assert trace.family("sm90_xmma_gemm_e4m3") == "gemm"
    assert trace.family("triton_poi_fused_add_0") == "other"


def test_scenarios_parse_or_fail_by_name():
    assert bp.parse_scenarios("mixed:8192, decode:1") == [("mixed", 8192), ("decode", 1)]
    for bad in ("mixed", "mixed:0", "warm:4", "decode:²", "decode:1,decode:1", ""):
        with pytest.raises(SystemExit, match="--scenarios"):
            bp.parse_scenarios(bad)


FAKE_MAIN = r'''
import gzip, json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
prof = json.loads(argv[argv.index("--profiler-config") + 1]) if "--profiler-config" in argv else None
PIECE = int(argv[argv.index("--long-prefill-token-threshold") + 1]) if "--long-prefill-token-threshold" in argv else 100000
lock = threading.Lock()
reqs = {}          # id -> {"todo": prompt tokens left, "out": tokens left, "q": [chunks]}
P = {"on": False, "left": 0, "prefix": None, "events": [], "corr": 1}
def now_us():
    return time.perf_counter() * 1e6
def write_trace():
    name = "%s_dp0_pp0_tp0_rank0.%d.pt.trace.json.gz" % (P["prefix"] or "rank0", time.time_ns())
    tmp = os.path.join(prof["torch_profiler_dir"], name + ".part")
    with gzip.open(tmp, "wt") as fh:
        json.dump({"schemaVersion": 1, "traceEvents": P["events"]}, fh)
    os.replace(tmp, os.path.join(prof["torch_profiler_dir"], name))
    P["on"], P["events"] = False, []
def engine():
    while True:
        with lock:
            live = [r for r in reqs.values() if not r.get("gone")]
        if not live:
            time.sleep(0.001); continue
        # one request's prompt piece at a time (a piece only while another runs, as vLLM 0.31+)
        ctx = [r for r in live if r["todo"] > 0][:1]
        gen = [r for r in live if r["todo"] == 0 and r["out"] > 0]
        piece = min(ctx[0]["todo"], PIECE if gen else 100000) if ctx else 0
        if not ctx and not gen:
            time.sleep(0.001); continue
        t0 = now_us()
        time.sleep(0.002 + (0.006 if piece else 0))   # a mixed step costs 6 ms more, in eager kernels
        t1 = now_us()
        if P["on"]:
            ev, c = P["events"], P["corr"]
            name = "execute_context_%d(%d)_generation_%d(%d)" % (len(ctx), piece, len(gen), len(gen))
            ev.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 2, "ts": t0, "dur": t1 - t0})
            if os.environ.get("VLLM_CUSTOM_SCOPES_FOR_PROFILING") == "1":
                ev.append({"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: preprocess", "pid": 1, "tid": 2,
                           "ts": t0 + 1, "dur": 1500 if piece else 100})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 2, "ts": t0 + 1, "dur": 5, "args": {"correlation": c}})
            ev.append({"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "pid": 0, "tid": 7, "ts": t0 + 10, "dur": 1500, "args": {"correlation": c, "stream": 7}})
            if piece:
                for j in range(6):
                    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 2, "ts": t0 + 20 + j, "dur": 1, "args": {"correlation": c + 1 + j}})
                    ev.append({"ph": "X", "cat": "kernel", "name": "chunk_fwd_kernel_o", "pid": 0, "tid": 7, "ts": t0 + 2000 + 900 * j, "dur": 800, "args": {"correlation": c + 1 + j, "stream": 7}})
            P["corr"] = c + 7
            P["left"] -= 1
            if P["left"] == 0:
                write_trace()
        with lock:
            if ctx:
                ctx[0]["todo"] -= piece
                if ctx[0]["todo"] == 0:
                    ctx[0]["q"].append("first")
            for r in gen:
                r["out"] -= 1; r["q"].append("tok")
threading.Thread(target=engine, daemon=True).start()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def reply(self, code, body=b""):
        self.send_response(code); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        self.reply(200, b"ok")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        if self.path == "/start_profile":
            if prof is None:
                return self.reply(404, b"not found")
            if P["on"]:
                return self.reply(500, b"ProfilerAlreadyActiveError")
            P["prefix"] = (body or {}).get("profile_prefix"); P["left"] = (body or {}).get("max_iterations") or -1
            P["on"] = True
            return self.reply(200)
        if self.path == "/stop_profile":
            if P["on"]:
                write_trace()
            return self.reply(200)
        rid = object()
        r = {"todo": len(body["prompt"]), "out": body["max_tokens"], "q": []}
        with lock:
            reqs[rid] = r
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
        def send(data):
            data = b"data: " + data + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data)); self.wfile.flush()
        sent = 0
        try:
            while sent < body["max_tokens"]:
                with lock:
                    got = r["q"][:]; r["q"].clear()
                for item in got:
                    if item == "tok":
                        send(json.dumps({"choices": [{"text": "x"}]}).encode()); sent += 1
                    elif body["max_tokens"] == 1:
                        send(json.dumps({"choices": [{"text": "x"}]}).encode()); sent = 1
                time.sleep(0.0005)
            send(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n"); self.wfile.flush()
        except OSError:
            pass   # the client left: vLLM aborts the request
        finally:
            r["gone"] = True
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_profiles_each_scenario_on_a_server_that_writes_traces(tmp_path, monkeypatch, capsys):
    vllm_cli.install(tmp_path, monkeypatch, FAKE_MAIN)
    d = tmp_path / "b"
    assert br.main(["prepare", str(d), "--ple-rows", "100000"]) == 0
    out = tmp_path / "raw.jsonl"
    assert bp.main(["run", str(d), "--configs", "shared-25,stock", "--out", str(out), "--steps", "30",
                    "--scenarios", "mixed:2000,decode:2,prefill:300", "--port", "18840", "--boot-timeout", "120",
                    "--set", "GPU_MEM=0.7"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    booted = [r for r in rows if r.get("event") == "booted"]
    assert [r["label"] for r in booted] == ["shared-25", "stock"]
    for r in booted:  # the profiler is one more deviation, into the run's log directory
        cfg = json.loads(r["argv"][r["argv"].index("--profiler-config") + 1])
        assert cfg["torch_profiler_dir"] == str(tmp_path / f"profile-{r['label']}")
        assert cfg["torch_profiler_with_stack"] is False and cfg["ignore_frontend"] is True
        assert any(x.startswith("--profiler-config ") for x in r["deviations"])
        assert r["env"]["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] == "1"
    prof = {(r["label"], r["scenario"]): r for r in rows if r.get("study") == "profile"}
    assert set(prof) == {(lb, s) for lb in ("shared-25", "stock") for s in ("mixed:2000", "decode:2", "prefill:300")}
    # the worker stopped itself after --steps steps; the trace is read, then removed
    assert prof[("stock", "decode:2")]["summary"]["steps"] == 30
    assert not list(tmp_path.glob("profile-*/*.pt.trace.json*"))
    # shared-25: the prompt's 25-token pieces beside the stream, and the stream's steps alone before it
    mixed = prof[("shared-25", "mixed:2000")]["summary"]["classes"]
    alone, piece = "execute_context_0(0)_generation_1(1)", "execute_context_1(25)_generation_1(1)"
    assert mixed[alone]["steps"] >= 5 and mixed[piece]["steps"] >= 10
    assert mixed[piece]["eager"] == 6 and mixed[alone]["eager"] == 0
    # stock takes the prompt whole beside the stream (no piece threshold rendered), in one step
    assert any(c["ctx_tokens"] == 2000 for c in prof[("stock", "mixed:2000")]["summary"]["classes"].values())
    assert prof[("shared-25", "prefill:300")]["client"]["ttft_s"] > 0
    assert prof[("stock", "decode:2")]["summary"]["classes"]["execute_context_0(0)_generation_2(2)"]["graphs"] == 1
    rep = bp.report(rows, ref="stock")
    d25 = rep["shared-25"]["mixed_vs_decode"][piece]
    assert d25["against"] == alone
    # the fake's mixed step: 6 ms more, in 6 eager GDN-like kernels of 0.8 ms
    assert d25["figures"]["eager"] == 6 and 4.0 < d25["figures"]["period_ms"] < 12.0
    assert d25["by_family"]["gdn"] == pytest.approx(4.8, abs=0.01)
    assert d25["sections"]["gpu_model_runner: preprocess"] == pytest.approx(1.4, abs=0.01)
    assert "execute_context_0(0)_generation_2(2)" in rep["shared-25"]["vs_ref"]
    assert rep["stock"]["traces"]["decode:2"]["steps"] == 30 and rep["stock"]["traces"]["decode:2"]["outside"] == 0
    assert bp.main(["report", str(out), "--ref", "stock", "--json", str(tmp_path / "s.json"),
                    "--png", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert f"  {piece} - {alone}: period +" in text and "gdn +4.80" in text
    assert "  trace decode:2: 30 steps, 30 GPU events in them (0 by stream order), 0 outside every step" in text
    assert json.loads((tmp_path / "s.json").read_text()) == json.loads(json.dumps(rep))
    with pytest.raises(SystemExit, match="--ref nvidia: no profile rows of that label"):
        bp.main(["report", str(out), "--ref", "nvidia"])


def test_a_bad_argument_fails_before_any_server_boots(tmp_path, monkeypatch):
    vllm_cli.install(tmp_path, monkeypatch, "raise SystemExit('no server should start')")
    d = tmp_path / "b"
    assert br.main(["prepare", str(d), "--ple-rows", "100000"]) == 0
    for extra, msg in ((["--scenarios", "mixed:x"], "--scenarios"), (["--steps", "2"], "--steps 2"),
                       (["--configs", "nope"], "--configs 'nope'")):
        with pytest.raises(SystemExit, match=msg):
            bp.main(["run", str(d), "--out", str(tmp_path / "r.jsonl"), *extra])
    assert not (tmp_path / "r.jsonl").exists()


def test_a_term_mid_run_stops_the_server_it_started(tmp_path, monkeypatch):
    """gpu_session stops a phase with `timeout` (SIGTERM): the bench must still stop its server, which
    runs in a session of its own and would otherwise hold the GPU for every later phase."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    vllm_cli.install(tmp_path, monkeypatch, FAKE_MAIN)
    d = tmp_path / "b"
    assert br.main(["prepare", str(d), "--ple-rows", "100000"]) == 0
    out = tmp_path / "raw.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "lab.bench_profile", "run", str(d), "--configs", "shared-25",
                             "--out", str(out), "--scenarios", "decode:1", "--steps", "100000", "--port", "18845"],
                            env={**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"] + os.pathsep + str(br.ROOT)},
                            cwd=br.ROOT)
    end = time.monotonic() + 60
    while not (out.exists() and "booted" in out.read_text()) and time.monotonic() < end:
        time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", 18845), timeout=5):
        pass  # the server is up, the profile running (it waits for 100,000 steps)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 128 + signal.SIGTERM
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", 18845), timeout=5).close()


def test_a_trace_still_being_written_is_not_taken(tmp_path):
    import time

    p = tmp_path / "decode-1_dp0_rank0.5.pt.trace.json.gz"
    with gzip.open(p, "wt") as fh:
        json.dump({"traceEvents": synthetic() * 50}, fh)
    whole = p.read_bytes()
    p.write_bytes(whole[: len(whole) // 2])  # the worker is half way through
    assert not bp._whole(p)
    with pytest.raises(RuntimeError, match=r"no readable decode-1_\*.pt.trace.json.gz .* after 1 s"):
        bp.find_trace(tmp_path, "decode-1", time.time() - 5, timeout=1)
    p.write_bytes(whole)
    assert bp._whole(p) and bp.find_trace(tmp_path, "decode-1", time.time() - 5, timeout=5) == p
    # a trace older than the scenario is another scenario's
    with pytest.raises(RuntimeError):
        bp.find_trace(tmp_path, "decode-1", time.time() + 60, timeout=1)
