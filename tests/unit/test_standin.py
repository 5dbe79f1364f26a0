"""The stand-in vLLM server is what every host-side gate is proven against, so it is tested
for the behaviour the gates and the lifecycle depend on (real HTTP, real exposition format)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standin"))
from harness import SERVER, StandIn  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str) -> float:
    return sum(s.value for s in fams[name].samples if s.name in (name, name + "_total"))


def test_argv_recorded_and_unknown_flags_accepted():
    with StandIn("--max-model-len", "32768", "--no-enable-prefix-caching", "-cc.mode=3", "--weird", "x",
                 "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}') as s:
        got = requests.get(s.url + "/standin/argv", timeout=5).json()
    assert got["argv"][:2] == ["serve", "/models/standin"]
    assert "-cc.mode=3" in got["unknown"] and "--weird" in got["unknown"]
    assert got["max_model_len"] == 32768 and got["enable_prefix_caching"] is False
    assert json.loads(got["speculative_config"])["num_speculative_tokens"] == 2


def test_api_key_guards_v1_only(monkeypatch):
    with StandIn(env={"VLLM_API_KEY": "sk-test"}) as s:
        assert requests.get(s.url + "/v1/models", timeout=5).status_code == 401
        assert requests.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
        assert requests.get(s.url + "/v1/models", headers={"Authorization": "Bearer sk-test"}, timeout=5).status_code == 200
        assert requests.get(s.url + "/health", timeout=5).status_code == 200
        assert requests.get(s.url + "/metrics", timeout=5).status_code == 200
    with StandIn("--api-key", "sk-argv") as s:
        assert requests.get(s.url + "/v1/models", timeout=5).status_code == 401


def test_greedy_is_a_function_of_the_prompt_and_sampling_is_not():
    body = {"prompt": "Tell me about caches", "max_tokens": 20, "temperature": 0, "logprobs": 3}
    with StandIn() as s:
        a, b = (requests.post(s.url + "/v1/completions", json=body, timeout=10).json() for _ in range(2))
        hot = [requests.post(s.url + "/v1/completions", json={**body, "temperature": 1.0}, timeout=10).json()["choices"][0]["text"]
               for _ in range(4)]
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
    assert len(set(hot)) > 1


def test_metrics_are_real_exposition_and_count():
    with StandIn(env={"VLLM_PLE_MMAP": "1"}) as s:
        prompt = "ledger " * 600
        for _ in range(2):
            r = requests.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0}, timeout=10)
            assert r.status_code == 200
        text = requests.get(s.url + "/metrics", timeout=5).text
    fams = families(text)
    n = r.json()["usage"]["prompt_tokens"]
    assert value(fams, "vllm:prefix_cache_queries") == 2 * n
    # the repeat hits every whole block but never the last token
    assert value(fams, "vllm:prefix_cache_hits") == (n - 1) // 16 * 16
    assert value(fams, "vllm:generation_tokens") == 6
    assert fams["vllm:time_to_first_token_seconds"].type == "histogram"
    assert value(fams, "vllm:ple_mmap_lookup_ops") > 0 and value(fams, "vllm:ple_mmap_bytes") > 0
    assert "vllm:prompt_tokens_created" in fams and "process_cpu_seconds" in fams


def test_multiprocess_mode_drops_created_families_and_ple_off_by_default(tmp_path):
    with StandIn(env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}) as s:
        text = requests.get(s.url + "/metrics", timeout=5).text
    names = set(families(text))
    assert not [n for n in names if n.endswith("_created") or n.startswith(("process_", "python_"))]
    assert "vllm:prompt_tokens" in names
    assert not [n for n in names if n.startswith("vllm:ple_mmap")]


def test_running_gauge_follows_in_flight_requests_and_sigterm_drains():
    with StandIn(env={"STANDIN_DELAY_MS": "1500"}) as s:
        out = {}
        t = threading.Thread(target=lambda: out.update(r=requests.post(
            s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0}, timeout=20)))
        t.start()
        time.sleep(0.4)
        running = value(families(requests.get(s.url + "/metrics", timeout=5).text), "vllm:num_requests_running")
        start = time.monotonic()
        rc = s.stop()
        t.join(10)
        assert running == 1.0
        assert rc == 0 and time.monotonic() - start < 5
        assert out["r"].status_code == 200 and out["r"].json()["usage"]["completion_tokens"] == 4
        s.wait_for_line("Application shutdown complete")


def test_max_num_seqs_queues_into_waiting():
    with StandIn("--max-num-seqs", "1", env={"STANDIN_DELAY_MS": "1200"}) as s:
        threads = [threading.Thread(target=requests.post, args=(s.url + "/v1/completions",),
                                    kwargs={"json": {"prompt": f"q{i}", "max_tokens": 2}, "timeout": 20}) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.4)
        fams = families(requests.get(s.url + "/metrics", timeout=5).text)
        for t in threads:
            t.join(20)
    assert value(fams, "vllm:num_requests_running") == 1 and value(fams, "vllm:num_requests_waiting") == 1


def test_die_at_boot_exits_with_the_code_and_never_listens():
    proc = subprocess.run([sys.executable, str(SERVER), "serve", "m", "--port", "0"], capture_output=True, text=True,
                          env={"STANDIN_DIE_AT_BOOT": "3", "STANDIN_BOOT_SECONDS": "0.1", "PATH": "/usr/bin:/bin"}, timeout=20)
    assert proc.returncode == 3
    assert "Engine core initialization failed" in proc.stdout and "Starting vLLM API server" not in proc.stdout


def test_missing_absolute_model_path_fails_like_vllm(tmp_path):
    proc = subprocess.run([sys.executable, str(SERVER), "serve", str(tmp_path / "nope"), "--port", "0"],
                          capture_output=True, text=True, env={"STANDIN_BOOT_SECONDS": "0"}, timeout=20)
    assert proc.returncode == 1 and "Incorrect path_or_model_id" in proc.stdout


def test_unknown_fault_is_refused():
    proc = subprocess.run([sys.executable, str(SERVER), "serve", "m"], capture_output=True, text=True,
                          env={"STANDIN_FAULTS": "nondeterminstic"}, timeout=20)
    assert proc.returncode != 0 and "unknown fault" in proc.stderr


def test_chat_tools_messages_and_effort_shapes():
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}}}
    with StandIn(faults="reject_high_effort") as s:
        chat = requests.post(s.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Forecast for Berlin over 3 days"}], "tools": [tool]}, timeout=10).json()
        call = chat["choices"][0]["message"]["tool_calls"][0]
        assert chat["choices"][0]["finish_reason"] == "tool_calls"
        assert json.loads(call["function"]["arguments"]) == {"city": "Berlin", "days": 3}
        low = requests.post(s.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "reasoning_effort": "low"}, timeout=10)
        high = requests.post(s.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "reasoning_effort": "high"}, timeout=10)
        msg = requests.post(s.url + "/v1/messages", json={
            "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": "high"}}, timeout=10)
        ok_msg = requests.post(s.url + "/v1/messages", json={
            "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, timeout=10).json()
        too_long = requests.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10**7}, timeout=10)
        wrong_model = requests.post(s.url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=10)
    assert low.status_code == 200
    assert high.status_code == 400 and "Unexpected reasoning effort high" in high.json()["error"]["message"]
    assert msg.status_code == 400
    assert ok_msg["type"] == "message" and ok_msg["content"][0]["type"] == "text" and ok_msg["usage"]["output_tokens"] == 4
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    assert wrong_model.status_code == 404


def test_streaming_sends_tokens_then_usage_then_done():
    with StandIn() as s:
        r = requests.post(s.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}, stream=True, timeout=10)
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][5:])["usage"]
    assert usage["completion_tokens"] == 5
    pieces = [json.loads(ln[5:])["choices"][0]["delta"].get("content") for ln in lines[1:-2]]
    assert len([p for p in pieces if p]) == 5


def test_anthropic_messages_stream_events_like_claude_code_expects():
    with StandIn() as s:
        r = requests.post(s.url + "/v1/messages", json={"max_tokens": 4, "stream": True,
                          "messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": "high"}},
                          stream=True, timeout=10)
        events = [ln[7:] for ln in r.iter_lines(decode_unicode=True) if ln.startswith("event: ")]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert events[:2] == ["message_start", "content_block_start"] and events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events.count("content_block_delta") == 4
