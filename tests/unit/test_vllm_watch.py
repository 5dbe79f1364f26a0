"""tools/vllm_watch.py on a real request log: the stand-in with vLLM's request logging on."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "standin"))
from harness import StandIn  # noqa: E402

from tools import vllm_watch  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def chat(url: str, messages: list, stream: bool = False) -> str:
    r = requests.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                          "stream": stream}, timeout=10, stream=stream)
    if stream:
        return "".join(r.iter_lines(decode_unicode=True)) and "(streamed)"
    return r.json()["choices"][0]["message"]["content"]


def test_two_interleaved_conversations_are_threaded_apart(tmp_path):
    sys_msg = {"role": "system", "content": "You are terse."}
    with StandIn("--enable-log-requests", "--enable-log-outputs", env={"STANDIN_STATS_SEC": "0.3"}) as s:
        a1 = [sys_msg, {"role": "user", "content": "Alpha question one?"}]
        b1 = [sys_msg, {"role": "user", "content": "Bravo question one?"}]
        ra = chat(s.url, a1)
        rb = chat(s.url, b1, stream=True)
        a2 = a1 + [{"role": "assistant", "content": ra}, {"role": "user", "content": "Alpha follow-up?"}]
        chat(s.url, a2)
        s.wait_for_line("Engine 000: Avg prompt throughput")
        log = "\n".join(s.lines)
    assert "details: prompt:" in log and "(streaming complete)" in log
    out = io.StringIO()
    w = vllm_watch.Watcher(out, colour=False)
    for line in log.splitlines():
        w.feed(line)
    text = out.getvalue().splitlines()
    users = [l for l in text if " user] " in l]
    assert users == ["[#1 user] Alpha question one?", "[#2 user] Bravo question one?", "[#1 user] Alpha follow-up?"]
    assert text.count("[#1 system] <system prompt>") == 1 and text.count("[#2 system] <system prompt>") == 1
    assert len([l for l in text if l.startswith("[#1 assistant]")]) == 2
    assert [l for l in text if l.startswith("[#2 assistant]")]
    assert any("prefix hits" in l for l in text)


def test_markers_and_segments_are_printable():
    out = vllm_watch.printable("<think>plan</think>ok <tool_call>{\"name\": \"f\"}</tool_call>\x07")
    assert "[reasoning: plan]" in out and "[tool_call: {\"name\": \"f\"}]" in out and "\\x07" in out


def test_cli_reads_a_file_and_warns_without_request_lines(tmp_path):
    f = tmp_path / "log.txt"
    f.write_text("INFO something unrelated\n")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "vllm_watch.py"), str(f)], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0 and "LOG_REQUESTS=1" in res.stderr
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "vllm_watch.py"), str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=20)
    assert res.returncode == 2
