"""`flash monitor`: the plan (pure data), its docker-py translation and the rendered config."""

from __future__ import annotations

import json
import re
import stat

import pytest

from dataclasses import asdict

from flash_cli import monitor, render
from flash_cli.__main__ import main
from flash_cli.settings import resolve


def plan_for(tmp_path, **over):
    return monitor.plan(resolve(overrides={k: str(v) for k, v in over.items()}), tmp_path)


def test_images_are_pinned_by_tag_and_digest():
    for ref in monitor.IMAGES.values():
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", ref), ref


def test_plan_renders_this_recipes_ports(tmp_path):
    p = plan_for(tmp_path, PORT=18301, MONITOR_PROM_PORT=29090, MONITOR_NODE_PORT=29100, MONITOR_GRAFANA_PORT=23000)
    prom = p.files["prometheus/prometheus.yml"]
    assert '"127.0.0.1:18301"' in prom and '"127.0.0.1:29100"' in prom and '"127.0.0.1:29090"' in prom
    assert "18300" not in prom
    assert "http://127.0.0.1:29090" in p.files["grafana/provisioning/datasources/flash.yml"]
    assert {"prometheus/rules/flash-recording.yml", "prometheus/rules/flash-alerts.yml",
            "grafana/dashboards/flash.json"} <= set(p.files)
    by = p.containers
    assert "--web.listen-address=127.0.0.1:29090" in by["prometheus"].command
    assert by["grafana"].env["GF_SERVER_HTTP_PORT"] == "23000"
    assert p.urls["grafana"] == "http://127.0.0.1:23000/d/flash-qwen38"


def test_no_secret_in_env_or_argv(tmp_path):
    for c in plan_for(tmp_path).containers.values():
        text = json.dumps(asdict(c)) + " ".join(render.to_docker_run(c))
        assert "GF_SECURITY_ADMIN_PASSWORD=" not in text


def test_docker_py_translation_accepts_every_kwarg(tmp_path):
    """Push each container's kwargs through docker-py's real create translation (no daemon)."""
    from docker.api.client import APIClient
    from docker.models.containers import RUN_CREATE_KWARGS, RUN_HOST_CONFIG_KWARGS, _create_container_args

    api = APIClient(base_url="tcp://127.0.0.1:1", version="1.41")
    for role, c in plan_for(tmp_path).containers.items():
        kwargs = render.to_kwargs(c)
        assert not set(kwargs) - set(RUN_CREATE_KWARGS) - set(RUN_HOST_CONFIG_KWARGS) - {"detach", "image", "command"}
        assert not {"entrypoint", "healthcheck", "ipc_mode", "shm_size"} & set(kwargs)  # the image's own
        create = _create_container_args(dict(kwargs, version="1.41"))
        hc = create.pop("host_config")
        assert create.pop("name") == c.name
        config = api.create_container_config(**create)
        assert config["Image"] == c.image and config["Labels"]["org.flash.monitor"] == "qwen38-flash"
        assert config["Labels"]["org.flash.role"] == role and config["Entrypoint"] is None
        assert hc["NetworkMode"] == "host" and hc["RestartPolicy"]["Name"] == "unless-stopped"
        assert hc["LogConfig"]["Config"] == {"max-size": "20m", "max-file": "2"}
        mounts = {m["Target"]: m for m in hc["Mounts"]}
        if role == "node-exporter":
            assert hc["PidMode"] == "host" and config["User"] == "65534:65534"
            host = mounts["/host"]
            assert host["Source"] == "/" and host["ReadOnly"] and host["BindOptions"] == {"Propagation": "rslave"}
        if role == "grafana":
            assert mounts["/run/secrets/grafana-admin"]["ReadOnly"]
            assert mounts["/var/lib/grafana"] == {"Target": "/var/lib/grafana", "Source": "qwen38-flash-grafana-data",
                                                  "Type": "volume", "ReadOnly": False}


def test_dry_run_line_is_the_runspecs(tmp_path):
    node = render.to_docker_run(plan_for(tmp_path).containers["node-exporter"])
    assert node[:5] == ["docker", "run", "-d", "--name", "qwen38-flash-node-exporter"]
    assert "--pid" in node and "type=bind,source=/,target=/host,readonly,bind-propagation=rslave" in node
    assert "--entrypoint" not in node and "--ipc" not in node and "--health-cmd" not in node
    assert node[-5:-3] == [monitor.IMAGES["node-exporter"], "--web.listen-address=127.0.0.1:19100"]


def test_write_files_is_complete_and_the_password_private(tmp_path):
    p = plan_for(tmp_path)
    monitor.write_files(p)
    for rel in p.files:
        assert (p.config_dir / rel).read_text() == p.files[rel]
    pw = p.config_dir / "grafana-admin"
    first = pw.read_text()
    assert len(first) >= 24
    monitor.write_files(p)  # idempotent: the password is generated once
    assert pw.read_text() == first
    assert not list(p.config_dir.rglob(".*.tmp*"))


def test_dry_run_prints_docker_run_lines_and_touches_nothing(capsys, tmp_path):
    assert main(["monitor", "up", "--dry-run", "PORT=18311"]) == 0
    out = capsys.readouterr().out
    assert out.count("docker run -d") == 3 and "@sha256:" in out and "# scrapes: http://127.0.0.1:18311/metrics" in out
    assert main(["monitor", "up", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["role"] for c in doc["containers"]] == list(monitor.ROLES)
    from flash_cli.state import state_dir
    assert not (state_dir() / "monitor-qwen38-flash").exists()


def test_render_refuses_a_reshaped_shipped_file(monkeypatch, tmp_path):
    (tmp_path / "prometheus.yml").write_text("scrape_configs: []\n")
    monkeypatch.setattr(monitor, "OBS", tmp_path)
    with pytest.raises(RuntimeError, match="vllm target"):
        monitor.render_prometheus("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
