"""`flash monitor` exposes nothing unauthenticated beyond loopback, and its secret stays private
(issue 14)."""

from __future__ import annotations

import os
import stat

import pytest

from flash_cli import monitor, render
from flash_cli.errors import FlashError
from flash_cli.settings import resolve


def plan_for(tmp_path, uid=1000, **over):
    return monitor.plan(resolve(overrides={k: str(v) for k, v in over.items()}), tmp_path / "state", uid=uid)


def listen(p):
    by = p.containers
    addr = lambda c: next(a.split("=", 1)[1] for a in c.command if a.startswith("--web.listen-address="))
    return addr(by["prometheus"]), addr(by["node-exporter"]), by["grafana"].env


def test_an_exposed_api_does_not_expose_the_monitor(tmp_path):
    p = plan_for(tmp_path, BIND="0.0.0.0", API_KEY="auto")
    prom, node, genv = listen(p)
    assert prom == "127.0.0.1:19090" and node == "127.0.0.1:19100"
    assert genv["GF_SERVER_HTTP_ADDR"] == "127.0.0.1" and genv["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert '"127.0.0.1:18300"' in p.files["prometheus/prometheus.yml"]  # still scrapes the API
    assert not p.exposed


@pytest.mark.parametrize("mbind", ["0.0.0.0", "192.168.7.2", "::"])
def test_monitor_bind_beyond_loopback_requires_grafana_login_and_keeps_prometheus_local(tmp_path, mbind):
    p = plan_for(tmp_path, MONITOR_BIND=mbind)
    prom, node, genv = listen(p)
    assert prom == "127.0.0.1:19090" and node == "127.0.0.1:19100"  # no auth: never published
    assert genv["GF_SERVER_HTTP_ADDR"] == mbind
    assert genv["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in genv
    assert "http://127.0.0.1:19090" in p.files["grafana/provisioning/datasources/flash.yml"]
    assert p.exposed


def test_monitor_bind_is_validated_by_the_settings_table(tmp_path):
    with pytest.raises(FlashError, match="MONITOR_BIND"):
        plan_for(tmp_path, MONITOR_BIND="not-an-address")


def test_password_file_is_0600_and_folders_0700_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        p = plan_for(tmp_path, uid=os.getuid() or 1000)
        if os.getuid() == 0:
            p.uid = 0
        monitor.write_files(p)
    finally:
        os.umask(old)
    mode = lambda path: stat.S_IMODE(path.stat().st_mode)
    assert mode(p.config_dir / "grafana-admin") == 0o600
    assert mode(p.config_dir) == 0o700 and mode(p.config_dir.parent) == 0o700
    # what the containers read through bind mounts holds no secret and stays readable to their users
    assert mode(p.config_dir / "prometheus") == 0o755
    assert mode(p.config_dir / "prometheus" / "prometheus.yml") == 0o644


def test_an_old_0644_password_file_is_repaired(tmp_path):
    p = plan_for(tmp_path, uid=os.getuid() or 1000)
    p.config_dir.mkdir(parents=True)
    (p.config_dir / "grafana-admin").write_text("old-secret")
    os.chmod(p.config_dir / "grafana-admin", 0o644)
    if os.getuid() == 0:
        p.uid = 0
    monitor.write_files(p)
    assert (p.config_dir / "grafana-admin").read_text() == "old-secret"
    assert stat.S_IMODE((p.config_dir / "grafana-admin").stat().st_mode) == 0o600


def test_grafana_runs_as_the_owner_of_the_password_file(tmp_path):
    grafana = plan_for(tmp_path, uid=1234).containers["grafana"]
    assert grafana.user == "1234:0"
    assert render.to_kwargs(grafana)["user"] == "1234:0"
    assert render.to_docker_run(grafana)[-2:] != ["--user", "1234:0"] and "--user" in render.to_docker_run(grafana)
    root = plan_for(tmp_path, uid=0).containers["grafana"]
    assert root.user == "" and "user" not in render.to_kwargs(root) and "--user" not in render.to_docker_run(root)
