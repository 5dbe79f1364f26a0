"""Engine tier: `flash monitor` against a real Docker Engine. No registry is reachable here, so
the pinned images cannot be pulled: `up` must fail cleanly (exit 4, the image named), while
`status` and `down` find the monitoring containers by label and nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def flash(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flash_cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "HOME": str(home), **env}, timeout=240)


def test_status_and_down_find_monitor_containers_by_label(docker_client, standin_image, tmp_path):
    name = f"flash-mon-{uuid.uuid4().hex[:6]}"
    other = docker_client.containers.run(standin_image, ["sleep", "300"], detach=True, network_mode="host",
                                         labels={"org.flash.monitor": "someone-else", "org.flash.role": "grafana"})
    mine = docker_client.containers.run(standin_image, ["sleep", "300"], detach=True, network_mode="host",
                                        name=f"{name}-prometheus",
                                        labels={"org.flash.monitor": name, "org.flash.role": "prometheus"})
    try:
        res = flash(tmp_path, "monitor", "status", "--json", NAME=name)
        assert res.returncode == 0, res.stderr
        rows = json.loads(res.stdout)["containers"]
        assert [(r["name"], r["role"], r["status"]) for r in rows] == [(f"{name}-prometheus", "prometheus", "running")]
        res = flash(tmp_path, "monitor", "down", "--dry-run", NAME=name)
        assert res.stdout.strip() == f"docker rm -f {name}-prometheus"
        res = flash(tmp_path, "monitor", "down", NAME=name)
        assert res.returncode == 0 and "removed 1 container" in res.stdout
        assert not docker_client.containers.list(all=True, filters={"label": f"org.flash.monitor={name}"})
        other.reload()
        assert other.status == "running"  # another server's monitor is not ours to remove
        res = flash(tmp_path, "monitor", "down", NAME=name)  # idempotent
        assert res.returncode == 0 and "removed 0 container" in res.stdout
    finally:
        for c in (other, mine):
            try:
                c.remove(force=True)
            except Exception:
                pass


def test_up_without_registry_fails_cleanly_after_rendering_config(docker_client, tmp_path):
    name = f"flash-mon-{uuid.uuid4().hex[:6]}"
    res = flash(tmp_path, "monitor", "up", NAME=name, PORT="18377")
    assert res.returncode == 4, res.stdout + res.stderr
    assert "cannot pull prom/prometheus:v3.5.0@sha256:" in res.stderr and "hint:" in res.stderr
    cfg = tmp_path / ".local" / "state" / "flash" / f"monitor-{name}" / "prometheus" / "prometheus.yml"
    assert '"127.0.0.1:18377"' in cfg.read_text()
    assert not docker_client.containers.list(all=True, filters={"label": f"org.flash.monitor={name}"})
