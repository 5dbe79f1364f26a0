"""Engine tier: `flash test` finds the server by its container labels (no --url) and reads from the
container whether the PLE counters must be there. The container is the stand-in image itself
(the same `vllm serve` argv shape a real deployment uses), so no image build is needed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(docker_client, image: str, env: dict) -> tuple[str, int, object]:
    name, port = f"flash-gate-{uuid.uuid4().hex[:6]}", free_port()
    labels = {"org.flash.name": name, "org.flash.port": str(port), "org.flash.bind": "127.0.0.1",
              "org.flash.served-model-name": "qwen3.8-flash-next", "org.flash.api-key": "none"}
    c = docker_client.containers.run(
        image, ["vllm", "serve", "/hf/snapshot", "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", "qwen3.8-flash-next", "--enable-auto-tool-choice"],
        detach=True, network_mode="host", name=name, labels=labels,
        environment={"STANDIN_SKIP_MODEL_CHECK": "1", "STANDIN_BOOT_SECONDS": "0.2", **env})
    for _ in range(100):
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return name, port, c
        except requests.RequestException:
            time.sleep(0.2)
    c.remove(force=True)
    raise AssertionError("stand-in container did not come up")


def flash_test(home: Path, name: str, *extra: str) -> tuple[int, dict]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("STANDIN_")}, "HOME": str(home), "NAME": name}
    res = subprocess.run([sys.executable, "-m", "flash_cli", "test", "TEST_PREFILL_TOKENS=1024", "TEST_DECODE_TOKENS=32",
                          *extra, "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    return res.returncode, json.loads(res.stdout)


def test_flash_test_finds_the_container_and_requires_ple_counters_it_promises(docker_client, standin_image, tmp_path):
    name, port, c = start(docker_client, standin_image, {"VLLM_PLE_MMAP": "1"})
    try:
        rc, report = flash_test(tmp_path, name)
        assert report["url"] == f"http://127.0.0.1:{port}" and report["model"] == "qwen3.8-flash-next"
        assert rc == 0, report
        metrics = next(ch for ch in report["checks"] if ch["name"] == "metrics")
        assert "PLE counters: 8/8" in metrics["detail"]
    finally:
        c.remove(force=True)
    # the patch on, the counters stuck in the engine process (stock vLLM without multiprocess mode)
    name, port, c = start(docker_client, standin_image, {"VLLM_PLE_MMAP": "1", "STANDIN_FAULTS": "ple_engine_only"})
    try:
        rc, report = flash_test(tmp_path, name, "--only", "prefill", "--only", "metrics")
        failed = [ch["name"] for ch in report["checks"] if ch["status"] == "fail"]
        assert rc == 1 and failed == ["metrics"], report
    finally:
        c.remove(force=True)
