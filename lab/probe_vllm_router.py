#!/usr/bin/env python3
"""Run a `vllm-router` binary in PD mode in front of the faithful fakes (tests/fakes/pd.py) and the
stand-in servers (tests/standin) and print what it does with what `pd` needs (issue 34's check:
docs/MULTINODE.md "Why our own router"). Install it anywhere first, e.g.

    python3 -m venv /tmp/vr && /tmp/vr/bin/pip install vllm-router==0.1.17
    .venv/bin/python -m lab.probe_vllm_router /tmp/vr/bin/vllm-router

Loopback only; every process it starts is stopped before it returns.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

KEY = "sk-probe-0123456789"
BODY = {"model": "m", "prompt": "hi", "max_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmRouter:
    def __init__(self, binary: str, prefill: str, decode: str, *args: str, env: dict | None = None):
        self.port, self.mport = free_port(), free_port()
        argv = [binary, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode, "--host", "127.0.0.1",
                "--port", str(self.port), "--prometheus-port", str(self.mport), "--policy", "round_robin",
                "--worker-startup-timeout-secs", "30", *args]
        self.log = tempfile.NamedTemporaryFile("w", prefix="vllm-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(120):
            try:
                requests.get(self.url + "/health", timeout=1)
                return
            except requests.RequestException:
                time.sleep(0.5)
        raise SystemExit(f"vllm-router did not start: {Path(self.log.name).read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def say(what: str, r: requests.Response | str) -> None:
    text = r if isinstance(r, str) else f"HTTP {r.status_code} {r.text[:120]!r}"
    print(f"- {what}: {text.replace(KEY, '<KEY>')}")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    binary = sys.argv[1]
    from tests.fakes.pd import pair  # run from the repository root (python3 -m lab.probe_vllm_router)

    version = subprocess.run([str(Path(binary).with_name("python")), "-c",
                              "import importlib.metadata as m; print(m.version('vllm-router'))"],
                             capture_output=True, text=True).stdout.strip()
    print(f"vllm-router {version or '?'} ({binary})")

    # 1. key-protected servers; the deployment's key given as the environment's OPENAI_API_KEY
    p, d = pair(api_key=KEY)
    r = VllmRouter(binary, p.url, d.url, env={"OPENAI_API_KEY": KEY})
    try:
        for label, hdr in (("no client key", {}), ("a wrong client key", {"Authorization": "Bearer wrong"})):
            say(f"POST /v1/completions with {label}", requests.post(r.url + "/v1/completions", json=BODY,
                                                                   headers=hdr, timeout=30))
        if p.seen:
            kv = p.seen[-1]["body"].get("kv_transfer_params")
            say("prefill leg's kv_transfer_params / max_tokens / stream / min_tokens",
                f"{json.dumps(kv)} / {p.seen[-1]['body'].get('max_tokens')} / {p.seen[-1]['body'].get('stream')} / "
                f"{p.seen[-1]['body'].get('min_tokens')}")
            say("Authorization sent to the servers", p.seen[-1]["headers"].get("authorization", "(none)"))
        if d.seen:
            say("decode leg got do_remote_prefill", str(d.seen[-1]["body"]["kv_transfer_params"].get("do_remote_prefill")))
        s = requests.post(r.url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 3, "stream": True}, stream=True, timeout=30)
        lines = [x for x in s.iter_lines() if x]
        say("streaming chat", f"HTTP {s.status_code}, {len(lines)} SSE lines, last {lines[-1][:40] if lines else None}")
        d.health = 503
        time.sleep(1)
        say("GET /health with the decode server's /health at 503", requests.get(r.url + "/health", timeout=10))
        d.health = 200
        d.stop()
        n = len(p.seen)
        t = time.monotonic()
        resp = requests.post(r.url + "/v1/completions", json=BODY, timeout=120)
        say(f"POST with the decode server stopped ({time.monotonic() - t:.2f} s, prefill requests spent: "
            f"{len(p.seen) - n})", resp)
        say("GET /health with the decode server stopped", requests.get(r.url + "/health", timeout=10))
        say("GET /metrics on the API port", requests.get(r.url + "/metrics", timeout=10))
        m = requests.get(f"http://127.0.0.1:{r.mport}/metrics", timeout=10)
        fams = [x for x in m.text.splitlines() if x.startswith("# TYPE")]
        say("GET /metrics on --prometheus-port", f"HTTP {m.status_code}, {len(fams)} families, "
            f"servers' vllm:* families: {'vllm:' in m.text}")
    finally:
        r.stop()
        p.stop()

    # 2. --api-key in argv only (the option its help gives for workers' authorization)
    p, d = pair(api_key=KEY)
    r = VllmRouter(binary, p.url, d.url, "--api-key", KEY)
    try:
        resp = requests.post(r.url + "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        say("with --api-key KEY (argv) only: POST with the right client key", resp)
        if p.seen:
            say("Authorization sent to the servers", p.seen[-1]["headers"].get("authorization", "(none)"))
    finally:
        r.stop()
        p.stop()
        d.stop()

    # 3. the Anthropic Messages API against two NixlConnector stand-ins
    from tests.standin.harness import StandIn

    kvc = '{"kv_connector":"NixlConnector","kv_role":"%s"}'
    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.9.8.7", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}
    with StandIn("--kv-transfer-config", kvc % "kv_producer", env=side) as sp, \
            StandIn("--kv-transfer-config", kvc % "kv_consumer", env=side) as sd:
        r = VllmRouter(binary, sp.url, sd.url)
        try:
            msg = {"model": "qwen3.8-flash-next", "max_tokens": 16, "stream": True,
                   "messages": [{"role": "user", "content": "Say hi"}]}
            s = requests.post(r.url + "/v1/messages", json=msg, stream=True, timeout=30)
            events = [x for x in s.iter_lines() if x.startswith(b"event: ")]
            kp = requests.get(sp.url + "/standin/argv", timeout=5).json()["kv_seen"]
            kd = requests.get(sd.url + "/standin/argv", timeout=5).json()["kv_seen"]
            say("POST /v1/messages (stream)", f"HTTP {s.status_code}, first {events[:1]}, last {events[-1:]}; "
                f"prefill saw do_remote_decode {[k.get('do_remote_decode') for k in kp]}, "
                f"decode saw do_remote_prefill {[k.get('do_remote_prefill') for k in kd]}")
        finally:
            r.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
