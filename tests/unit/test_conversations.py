"""`flash conversations` on a real request log: the stand-in with vLLM's request logging on."""

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

from flash_cli import conversations  # noqa: E402
from flash_cli.commands.conversations import lines  # noqa: E402

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
    w = conversations.Watcher(out, colour=False)
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
    out = conversations.printable("<think>plan</think>ok <tool_call>{\"name\": \"f\"}</tool_call>\x07")
    assert "[reasoning: plan]" in out and "[tool_call: {\"name\": \"f\"}]" in out and "\\x07" in out


def flash(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flash_cli", "conversations", *args], capture_output=True, text=True,
                          input=stdin, timeout=20, cwd=ROOT)


def test_cli_reads_a_file_or_stdin_and_warns_without_request_lines(tmp_path):
    f = tmp_path / "log.txt"
    f.write_text("INFO something unrelated\n")
    res = flash(str(f))
    assert res.returncode == 0 and "LOG_REQUESTS=1" in res.stderr
    res = flash(str(tmp_path / "nope"))
    assert res.returncode == 2 and f"log file '{tmp_path / 'nope'}' not found" in res.stderr
    prompt = "<|im_start|>user\nHello there?<|im_end|>\n<|im_start|>assistant\n"
    line = f"INFO Request chatcmpl-1 details: prompt: {prompt!r}, prompt_token_ids: [1], params"
    res = flash("-", "--no-color", stdin=line + "\n")
    assert res.returncode == 0 and res.stdout == "[#1 user] Hello there?\n" and res.stderr == ""


def test_docker_chunks_become_whole_lines():
    assert list(lines(["a\nb", "c\n", "", "d\ne"])) == ["a", "bc", "d", "e"]
    assert list(lines(["x\n"])) == ["x"]
