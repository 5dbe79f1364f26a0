"""The whole `flash` lifecycle against real containers on a real Docker Engine."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]


def post_chat(url: str, key: str | None = None, timeout: float = 60) -> tuple[int, dict]:
    body = json.dumps({"model": "qwen3.8-flash-next", "messages": [{"role": "user", "content": "Say hi."}],
                       "max_tokens": 16, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def test_dockerfile_builds_over_the_standin_base_with_labels(docker_client, built_image, setup_home):
    labels = docker_client.images.get(built_image).labels
    record = json.loads((setup_home / ".local" / "state" / "flash" / "images.json").read_text())[built_image]
    assert record["base_image"] == "flash-standin:test" and record["base_digest"].startswith("sha256:")
    assert record["patchset"] == labels["org.flash.patchset"]
    assert labels.get("org.flash.base") == "v0.33" and labels.get("qwen38.base") == "v0.33"
    assert labels.get("org.flash.patchset"), labels
    assert labels.get("org.flash.selfcheck") == "skipped"  # this base has no vLLM to check against


def test_serve_wait_test_status_logs_stop_start_rm(flash, docker_client):
    res = flash("serve", "published", "--start-check", "2")
    assert res.returncode == 0, res.stderr
    assert "starting" in res.stdout

    res = flash("wait", "--timeout", "120", "--interval", "0.5")
    assert res.returncode == 0, res.stderr
    assert "ready after" in res.stdout and "GPU KV cache size" in res.stdout
    assert f"{flash.url}/v1" in res.stdout
    assert "context: max model len 500,000 as the recipe asks" in res.stdout  # the boot log vs the labels

    res = flash("test", "--json")  # finds the server through the container's labels
    assert res.returncode == 0, res.stdout + res.stderr
    checks = {c["name"]: c["status"] for c in json.loads(res.stdout)["checks"]}
    assert checks["health"] == "pass" and checks["tool_call"] == "pass" and checks["determinism"] == "pass"
    assert checks["context"] == "pass"  # the recipe came from the container's labels

    res = flash("status", "--json")
    st = json.loads(res.stdout)
    assert st["state"] == "running" and st["api"] == "up" and st["profile"] == "published"
    assert st["requests_running"] == 0 and "GPU KV cache size" in st["kv_cache_line"]
    assert 2.0 < st["mtp_acceptance_length"] <= 2.6  # MTP=2: the stand-in's drafter, read from /metrics
    rates, by_depth = st["mtp_acceptance_per_position"], st["mtp_tokens_per_step_by_depth"]
    assert len(rates) == len(by_depth) == 2 and rates[0] > rates[1] > 0  # its acceptance falls with the position
    assert by_depth[-1] == pytest.approx(st["mtp_acceptance_length"], abs=2e-3)  # the server's own depth
    assert st["api_key"] is None and not st["exposed_without_key"]
    assert st["context"]["level"] == "ok" and st["memory"]["meminfo"]["MemAvailable"] > 0
    assert any("MemAvailable" in f["text"] for f in st["memory_findings"])
    assert "measured 1,234,567 tokens, predicted" in st["kv_cache_plan"]  # planner next to the boot log
    # ... from the prediction serve stored on the container (status does not re-plan on every call)
    stored = docker_client.containers.list(filters={"label": f"org.flash.name={flash.name}"})[0].labels
    assert f"predicted {json.loads(stored['org.flash.kv-plan'])['tokens']:,}" in st["kv_cache_plan"]

    res = flash("serve", "published", "--start-check", "1")  # the same recipe is not rebooted
    assert res.returncode == 0 and "already runs this recipe" in res.stdout

    res = flash("logs", "3")
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 3

    # stop drains: a request in flight finishes before the container stops
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(zip(("status", "body"), post_chat(flash.url))))
    slow = flash("serve", "published", "--start-check", "1", "CONTAINER_ENV=STANDIN_DELAY_MS=4000")
    assert slow.returncode == 0 and "replacing the existing container" in slow.stderr
    assert flash("wait", "--timeout", "120", "--interval", "0.5").returncode == 0
    t.start()
    time.sleep(1.0)
    begin = time.monotonic()
    res = flash("stop")
    took = time.monotonic() - begin
    t.join(30)
    assert res.returncode == 0, res.stderr
    assert "waiting for 1 running request" in res.stderr
    assert result.get("status") == 200, result  # not cut off by the stop
    assert took >= 2.0
    st = json.loads(flash("status", "--json").stdout)
    assert st["state"] == "exited"

    res = flash("start")
    assert res.returncode == 0 and "starting" in res.stdout
    assert flash("wait", "--timeout", "120", "--interval", "0.5").returncode == 0

    res = flash("rm")
    assert res.returncode == 0 and f"removed container {flash.name}" in res.stdout and "running" in res.stdout
    assert json.loads(flash("status", "--json").stdout)["state"] == "absent"
    res = flash("rm")
    assert res.returncode == 6 and f"no flash container named '{flash.name}'" in res.stderr
    res = flash("stop")  # idempotent, like status: nothing running is the state stop asks for
    assert res.returncode == 0 and f"no flash container named '{flash.name}'; nothing to stop" in res.stdout


def test_api_key_required_and_invisible_to_docker_inspect(flash, docker_client):
    res = flash("serve", "published", "API_KEY=on", "--start-check", "1")
    assert res.returncode == 0, res.stderr
    assert flash("wait", "--timeout", "120", "--interval", "0.5").returncode == 0
    key = (flash.home / ".local" / "state" / "flash" / f"api-key.{flash.name}").read_text().strip()
    mode = (flash.home / ".local" / "state" / "flash" / f"api-key.{flash.name}").stat().st_mode & 0o777
    assert key.startswith("sk-flash-") and mode == 0o600
    container = docker_client.containers.list(filters={"label": f"org.flash.name={flash.name}"})[0]
    assert key not in json.dumps(container.attrs)  # neither Args nor Env nor anything else
    assert post_chat(flash.url)[0] == 401
    assert post_chat(flash.url, key)[0] == 200
    st = json.loads(flash("status", "--json").stdout)
    assert st["api_key"] == key and st["api_key_mode"] == "required"
    # serving again keeps the same key
    assert flash("serve", "published", "API_KEY=on", "--start-check", "1").returncode == 0
    assert (flash.home / ".local" / "state" / "flash" / f"api-key.{flash.name}").read_text().strip() == key


def test_container_dying_at_start_is_reported_and_removed(flash, docker_client):
    res = flash("serve", "published", "CONTAINER_ENV=STANDIN_DIE_AT_BOOT=3 STANDIN_BOOT_SECONDS=0.3")
    assert res.returncode == 7
    assert "exit code 3" in res.stderr and "EngineCore failed to start" in res.stderr
    assert "container was removed" in res.stderr
    assert not docker_client.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})


def test_wait_fails_fast_when_the_container_dies_during_boot(flash):
    res = flash("serve", "published", "--start-check", "1",
                "CONTAINER_ENV=STANDIN_DIE_AT_BOOT=3 STANDIN_BOOT_SECONDS=24")
    assert res.returncode == 0, res.stderr
    begin = time.monotonic()
    res = flash("wait", "--timeout", "300", "--interval", "1")
    took = time.monotonic() - begin
    assert res.returncode == 7, res.stderr
    assert "exit code 3" in res.stderr and "EngineCore failed to start" in res.stderr
    assert took < 8 + 15  # death comes ~8 s after boot starts; wait must notice within 15 s
    assert "Traceback" not in res.stderr.split("EngineCore")[0]  # our own output has no traceback


def test_port_in_use_fails_doctor_and_serve(flash):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", flash.port))
        sock.listen()
        res = flash("doctor", "published", "--json")
        assert res.returncode == 1
        checks = json.loads(res.stdout)["checks"]
        port = [c for c in checks if c["section"] == "docker" and "port" in c["text"]]
        assert port and port[0]["status"] == "fail" and f"PORT={flash.port + 1}" in port[0]["text"]
        res = flash("serve", "published")
        assert res.returncode == 9 and "already in use" in res.stderr and "hint: pick another" in res.stderr


def test_image_missing(flash):
    res = flash("serve", "published", "IMAGE=flash-missing:none")
    assert res.returncode == 4 and "flash-missing:none" in res.stderr and "flash setup" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 5


def test_weights_missing(flash, tmp_path):
    res = flash("serve", "published", f"HF_CACHE={tmp_path / 'empty'}")
    assert res.returncode == 5 and "not in" in res.stderr and "hint:" in res.stderr


def test_daemon_unreachable(flash, tmp_path):
    env = {"DOCKER_HOST": f"unix://{tmp_path / 'no-docker.sock'}"}
    for cmd in (["serve", "published"], ["status"], ["wait"], ["stop"], ["rm"], ["logs"], ["monitor", "status"]):
        res = flash(*cmd, env=env)
        assert res.returncode == 3, (cmd, res.stderr)
        assert f"Error: Docker Engine unreachable at {env['DOCKER_HOST']}: No such file or directory" in res.stderr
        assert "hint:" in res.stderr and "Connection aborted" not in res.stderr and "Traceback" not in res.stderr
