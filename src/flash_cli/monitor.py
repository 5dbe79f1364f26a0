"""`flash monitor`: Prometheus, Grafana and node-exporter next to the server, as plain data first.

All three use the host network. Prometheus and node-exporter have no authentication, so they
always listen on 127.0.0.1; Grafana listens on MONITOR_BIND (loopback by default, where anonymous
users may view; anywhere else it requires a login). Prometheus scrapes the API where BIND
publishes it, with no extra docker network and no port publishing. Config comes from observability/ (rendered with this recipe's ports into the
state dir, atomically) so the shipped files and what runs never drift apart.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from . import state
from .profiles import REPO
from .render import to_docker_run
from .spec import LABEL, Mount, RunSpec

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


def helper(name: str, image: str, command: list[str], *, labels: dict[str, str], url: str,
           env: dict[str, str] | None = None, mounts: list[Mount] = (), pid_mode: str = "",
           user: str = "") -> RunSpec:
    """One monitoring container as a RunSpec, rendered and run like the server's (render.py):
    host network, restarted unless stopped, the image's own entrypoint and healthcheck."""
    return RunSpec(name=name, image=image, entrypoint=[], command=list(command), env=dict(env or {}),
                   labels=labels, mounts=list(mounts), network="host", ports={}, restart="unless-stopped",
                   gpus=False, ipc="", shm_size=0, log_max_size="20m", log_max_files=2, cpuset=None,
                   healthcheck={}, api_url=url, pid_mode=pid_mode, user=user)


@dataclass
class MonitorPlan:
    name: str  # the server's NAME: the monitor stack belongs to it
    config_dir: Path
    files: dict[str, str]  # path relative to config_dir → content
    containers: dict[str, RunSpec]  # role → its container
    urls: dict[str, str]
    exposed: bool = False  # Grafana listens beyond loopback (login required)
    uid: int = 0  # the invoking user: owner of the password file

    def as_dict(self) -> dict:
        return {"name": self.name, "config_dir": str(self.config_dir), "files": sorted(self.files),
                "urls": self.urls, "containers": [{"role": role, "docker_run": to_docker_run(c), "spec": asdict(c)}
                                                  for role, c in self.containers.items()]}


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


LOCAL = "127.0.0.1"  # where the unauthenticated listeners (Prometheus, node-exporter) always stay
GRAFANA_UID = 472  # grafana's uid in its image


def _is_loopback(addr: str) -> bool:
    import ipaddress

    return addr == "localhost" or ipaddress.ip_address(addr).is_loopback


def plan(settings, state_dir: Path, uid: int | None = None) -> MonitorPlan:
    """`uid`: the invoking user (os.getuid()). Not root: Grafana runs as that user so the admin
    password file can stay 0600 and owned by them (Grafana's image accepts any uid)."""
    name = settings["NAME"]
    bind = settings["BIND"]
    gbind = settings["MONITOR_BIND"]
    exposed = not _is_loopback(gbind)
    uid = os.getuid() if uid is None else uid
    host = LOCAL if bind in ("0.0.0.0", "::") else bind
    vllm, node = f"{host}:{settings['PORT']}", f"{LOCAL}:{settings['MONITOR_NODE_PORT']}"
    prom = f"{LOCAL}:{settings['MONITOR_PROM_PORT']}"
    ghost = LOCAL if gbind in ("0.0.0.0", "::") else gbind
    cdir = state_dir / f"monitor-{name}"
    labels = lambda role: {f"{LABEL}.monitor": name, f"{LABEL}.role": role}
    ro = lambda source, target: Mount("bind", target, str(source), read_only=True)
    urls = {"grafana": f"http://{ghost}:{settings['MONITOR_GRAFANA_PORT']}/d/flash-qwen38",
            "prometheus": f"http://{prom}", "node-exporter": f"http://{node}/metrics", "scrapes": f"http://{vllm}/metrics"}
    containers = {
        "prometheus": helper(
            f"{name}-prometheus", IMAGES["prometheus"],
            ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus",
             "--storage.tsdb.retention.time=30d", f"--web.listen-address={prom}"],
            mounts=[ro(cdir / "prometheus", "/etc/prometheus"), Mount("volume", "/prometheus", f"{name}-prometheus-data")],
            labels=labels("prometheus"), url=urls["prometheus"]),
        "grafana": helper(
            f"{name}-grafana", IMAGES["grafana"], [],
            env={"GF_SERVER_HTTP_ADDR": gbind, "GF_SERVER_HTTP_PORT": str(settings["MONITOR_GRAFANA_PORT"]),
                 "GF_PATHS_PROVISIONING": "/etc/grafana/provisioning",
                 # beyond loopback: nobody sees anything without logging in
                 **({"GF_AUTH_ANONYMOUS_ENABLED": "false", "GF_AUTH_DISABLE_LOGIN_FORM": "false",
                     "GF_USERS_ALLOW_SIGN_UP": "false"} if exposed else
                    {"GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer"}),
                 "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": "/etc/grafana/dashboards/flash.json",
                 # the admin password is a file (never env or argv: docker inspect shows both)
                 "GF_SECURITY_ADMIN_PASSWORD__FILE": "/run/secrets/grafana-admin"},
            mounts=[ro(cdir / "grafana/provisioning", "/etc/grafana/provisioning"),
                    ro(cdir / "grafana/dashboards", "/etc/grafana/dashboards"),
                    ro(cdir / "grafana-admin", "/run/secrets/grafana-admin"),
                    Mount("volume", "/var/lib/grafana", f"{name}-grafana-data")],
            labels=labels("grafana"), url=urls["grafana"], user="" if uid == 0 else f"{uid}:0"),
        "node-exporter": helper(
            f"{name}-node-exporter", IMAGES["node-exporter"],
            [f"--web.listen-address={node}", "--path.rootfs=/host", *NODE_EXPORTER_FLAGS],
            # rslave: mounts made on the host after the start show up inside (the filesystem panels)
            mounts=[Mount("bind", "/host", "/", read_only=True, propagation="rslave")],
            labels=labels("node-exporter"), url=urls["node-exporter"], pid_mode="host", user="65534:65534"),
    }
    files = config_files(vllm, node, prom)
    return MonitorPlan(name, cdir, files, containers, urls, exposed, uid)


def write_files(p: MonitorPlan) -> None:
    """Write the rendered config atomically (tmp sibling + rename per file). The state dir and
    the monitor folder are 0700; the Grafana admin password is generated once and always 0600,
    owned by whoever Grafana runs as (the invoking user, or grafana's uid when run as root).
    The config folders bind-mounted into the containers stay world-readable (0755/0644): the
    containers' users (65534, 472) read them, and they hold no secret."""
    for d in (p.config_dir.parent, p.config_dir):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)
    for rel, text in p.files.items():
        path = p.config_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in (path.parent, *path.parent.parents):
            if d == p.config_dir:
                break
            os.chmod(d, 0o755)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    secret = p.config_dir / "grafana-admin"
    if not secret.is_file():
        state.write_private(secret, secrets.token_urlsafe(24))  # mkstemp: 0600, unique, atomic
    os.chmod(secret, 0o600)  # also repairs a file an older flash left 0644
    if p.uid == 0:
        os.chown(secret, GRAFANA_UID, GRAFANA_UID)
