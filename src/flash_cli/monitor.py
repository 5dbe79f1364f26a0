"""`flash monitor`: Prometheus, Grafana and node-exporter next to the server, as plain data first.

All three use the host network and listen on BIND (loopback by default): Prometheus then scrapes
the API's published port and node-exporter over loopback, with no extra docker network and no
port publishing. Config comes from observability/ (rendered with this recipe's ports into the
state dir, atomically) so the shipped files and what runs never drift apart.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from .profiles import REPO
from .spec import LABEL

OBS = REPO / "observability"

# Pinned by tag AND digest (the digest wins; the tag says what it is). Multi-arch index digests
# (amd64 + arm64, the Spark is aarch64), cross-checked in several public deployments; this
# machine cannot reach Docker Hub, so `flash monitor up` is the first place they are pulled.
IMAGES = {
    "prometheus": "prom/prometheus:v3.5.0@sha256:63805ebb8d2b3920190daf1cb14a60871b16fd38bed42b857a3182bc621f4996",
    "grafana": "grafana/grafana:12.0.2@sha256:b5b59bfc7561634c2d7b136c4543d702ebcc94a3da477f21ff26f89ffd4214fa",
    "node-exporter": "prom/node-exporter:v1.9.1@sha256:d00a542e409ee618a4edc67da14dd48c5da66726bbd5537ab2af9c1dfc442c8a",
}
ROLES = tuple(IMAGES)
# The pressure collector (PSI) is on by default; the vmstat collector's default field filter
# leaves out pgscan_direct, which the dashboard's direct-reclaim panel reads.
VMSTAT_FIELDS = "^(oom_kill|pgpg|pswp|pg.*fault|pgscan_direct|pgsteal_direct|allocstall).*"
NODE_EXPORTER_FLAGS = ("--collector.pressure", f"--collector.vmstat.fields={VMSTAT_FIELDS}")

# the addresses the shipped observability/ files carry (the settings' defaults)
DEFAULT_VLLM = "127.0.0.1:18300"
DEFAULT_NODE = "127.0.0.1:19100"
DEFAULT_PROM = "127.0.0.1:19090"


@dataclass
class ContainerPlan:
    role: str
    name: str
    image: str
    command: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    volumes: dict[str, dict] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    pid_mode: str | None = None
    user: str | None = None

    def kwargs(self) -> dict:
        """`client.containers.run(**kwargs)` (docker-py 7.x names)."""
        kw = {"image": self.image, "command": self.command, "name": self.name, "detach": True,
              "network_mode": "host", "environment": dict(self.environment), "volumes": dict(self.volumes),
              "labels": dict(self.labels), "restart_policy": {"Name": "unless-stopped"},
              "log_config": {"Type": "json-file", "Config": {"max-size": "20m", "max-file": "2"}}}
        if self.pid_mode:
            kw["pid_mode"] = self.pid_mode
        if self.user:
            kw["user"] = self.user
        return kw

    def docker_run(self) -> list[str]:
        """The equivalent `docker run` argv (what --dry-run prints)."""
        argv = ["docker", "run", "-d", "--name", self.name, "--network", "host", "--restart", "unless-stopped"]
        if self.pid_mode:
            argv += ["--pid", self.pid_mode]
        if self.user:
            argv += ["--user", self.user]
        for k, v in self.labels.items():
            argv += ["--label", f"{k}={v}"]
        for k, v in self.environment.items():
            argv += ["-e", f"{k}={v}"]
        for src, m in self.volumes.items():
            argv += ["-v", f"{src}:{m['bind']}:{m['mode']}"]
        return argv + [self.image, *self.command]


@dataclass
class MonitorPlan:
    name: str  # the server's NAME: the monitor stack belongs to it
    config_dir: Path
    files: dict[str, str]  # path relative to config_dir → content
    containers: list[ContainerPlan]
    urls: dict[str, str]

    def as_dict(self) -> dict:
        return {"name": self.name, "config_dir": str(self.config_dir), "files": sorted(self.files),
                "urls": self.urls, "containers": [{"role": c.role, "docker_run": c.docker_run(), "kwargs": c.kwargs()}
                                                  for c in self.containers]}


def _swap(text: str, old: str, new: str, what: str) -> str:
    if old not in text:  # the shipped file changed shape: fail loudly rather than scrape the wrong port
        raise RuntimeError(f"{what}: expected {old!r} in the shipped file")
    return text.replace(old, new)


def render_prometheus(vllm: str, node: str, prom: str, interval: str | None = None) -> str:
    text = (OBS / "prometheus.yml").read_text(encoding="utf-8")
    text = _swap(text, f'"{DEFAULT_VLLM}"', f'"{vllm}"', "prometheus.yml vllm target")
    text = _swap(text, f'"{DEFAULT_NODE}"', f'"{node}"', "prometheus.yml node target")
    text = _swap(text, f'"{DEFAULT_PROM}"', f'"{prom}"', "prometheus.yml self target")
    if interval:
        text = _swap(text, "scrape_interval: 10s", f"scrape_interval: {interval}", "scrape_interval")
        text = _swap(text, "evaluation_interval: 10s", f"evaluation_interval: {interval}", "evaluation_interval")
    return text


def config_files(vllm: str, node: str, prom: str, interval: str | None = None) -> dict[str, str]:
    files = {"prometheus/prometheus.yml": render_prometheus(vllm, node, prom, interval)}
    for rule in sorted((OBS / "rules").glob("*.yml")):
        files[f"prometheus/rules/{rule.name}"] = rule.read_text(encoding="utf-8")
    ds = (OBS / "grafana/provisioning/datasources/flash.yml").read_text(encoding="utf-8")
    files["grafana/provisioning/datasources/flash.yml"] = _swap(ds, f"http://{DEFAULT_PROM}", f"http://{prom}", "datasource url")
    files["grafana/provisioning/dashboards/flash.yml"] = (OBS / "grafana/provisioning/dashboards/flash.yml").read_text(encoding="utf-8")
    for board in sorted((OBS / "grafana/dashboards").glob("*.json")):
        files[f"grafana/dashboards/{board.name}"] = board.read_text(encoding="utf-8")
    return files


def plan(settings, state_dir: Path) -> MonitorPlan:
    name = settings["NAME"]
    bind = settings["BIND"]
    host = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
    vllm, node = f"{host}:{settings['PORT']}", f"{host}:{settings['MONITOR_NODE_PORT']}"
    prom = f"{host}:{settings['MONITOR_PROM_PORT']}"
    cdir = state_dir / f"monitor-{name}"
    labels = lambda role: {f"{LABEL}.monitor": name, f"{LABEL}.role": role}
    containers = [
        ContainerPlan("prometheus", f"{name}-prometheus", IMAGES["prometheus"],
                      ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus",
                       "--storage.tsdb.retention.time=30d", f"--web.listen-address={bind}:{settings['MONITOR_PROM_PORT']}"],
                      volumes={str(cdir / "prometheus"): {"bind": "/etc/prometheus", "mode": "ro"},
                               f"{name}-prometheus-data": {"bind": "/prometheus", "mode": "rw"}},
                      labels=labels("prometheus")),
        ContainerPlan("grafana", f"{name}-grafana", IMAGES["grafana"], [],
                      environment={"GF_SERVER_HTTP_ADDR": bind, "GF_SERVER_HTTP_PORT": str(settings["MONITOR_GRAFANA_PORT"]),
                                   "GF_PATHS_PROVISIONING": "/etc/grafana/provisioning",
                                   "GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
                                   "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": "/etc/grafana/dashboards/flash.json",
                                   # the admin password is a file (never env or argv: docker inspect shows both)
                                   "GF_SECURITY_ADMIN_PASSWORD__FILE": "/run/secrets/grafana-admin"},
                      volumes={str(cdir / "grafana/provisioning"): {"bind": "/etc/grafana/provisioning", "mode": "ro"},
                               str(cdir / "grafana/dashboards"): {"bind": "/etc/grafana/dashboards", "mode": "ro"},
                               str(cdir / "grafana-admin"): {"bind": "/run/secrets/grafana-admin", "mode": "ro"},
                               f"{name}-grafana-data": {"bind": "/var/lib/grafana", "mode": "rw"}},
                      labels=labels("grafana")),
        ContainerPlan("node-exporter", f"{name}-node-exporter", IMAGES["node-exporter"],
                      [f"--web.listen-address={bind}:{settings['MONITOR_NODE_PORT']}", "--path.rootfs=/host",
                       *NODE_EXPORTER_FLAGS],
                      volumes={"/": {"bind": "/host", "mode": "ro,rslave"}}, labels=labels("node-exporter"),
                      pid_mode="host", user="65534:65534"),
    ]
    files = config_files(vllm, node, prom)
    urls = {"grafana": f"http://{host}:{settings['MONITOR_GRAFANA_PORT']}/d/flash-qwen38",
            "prometheus": f"http://{prom}", "node-exporter": f"http://{node}/metrics", "scrapes": f"http://{vllm}/metrics"}
    return MonitorPlan(name, cdir, files, containers, urls)


def write_files(p: MonitorPlan) -> None:
    """Write the rendered config atomically (tmp sibling + rename per file); the Grafana admin
    password is generated once, 0600, readable by the Grafana container's user (472)."""
    for rel, text in p.files.items():
        path = p.config_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    secret = p.config_dir / "grafana-admin"
    if not secret.is_file():
        tmp = secret.with_name(f".grafana-admin.tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24))
        try:
            os.chown(tmp, 472, 472)  # grafana's uid in its image
        except PermissionError:
            os.chmod(tmp, 0o644)  # not root: the file must still be readable inside the container
        os.replace(tmp, secret)
