"""PURE: a RunSpec → one docker-compose.yml (and the memory guard beside it), or a sparkrun recipe.

The compose file is what `flash serve` would run, to be started with no clone of the repository:
the same image, entrypoint and argv, environment, labels (so `flash status` finds it), mounts,
shm/ipc, log rotation, healthcheck and restart policy. Two things change on purpose:
- the API key is a compose `secrets:` file (mounted at /run/secrets/flash_api_key, read by the
  image's launcher), never a value in the file or in the environment;
- the HF cache and the key file are `${HF_CACHE:-…}` / `${FLASH_API_KEY_FILE:-./flash-api-key}`
  interpolations, so the file moves between machines.
Only keys that Compose v1.29 (Debian 12's docker-compose) and the v2 plugin both accept are used.
"""

from __future__ import annotations

from .guard import GUARD_LABEL, guard_spec
from .spec import KEY_TARGET, RunSpec

SECRET = "flash_api_key"
SECRET_TARGET = f"/run/secrets/{SECRET}"
KEY_FILE_DEFAULT = "./flash-api-key"


def _duration(ns: int) -> str:
    return f"{ns // 10**9}s"


def _esc(obj):
    """Compose interpolates `$VAR` in every value: a literal `$` (in EXTRA, a label) is `$$`."""
    if isinstance(obj, str):
        return obj.replace("$", "$$")
    if isinstance(obj, list):
        return [_esc(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _esc(v) for k, v in obj.items()}
    return obj


def _volumes(spec: RunSpec, hf_cache: str) -> tuple[list[dict], dict]:
    out, named = [], {}
    for m in spec.mounts:
        if m.target == KEY_TARGET:
            continue  # a compose secret instead (see _service)
        if m.kind == "tmpfs":
            size = m.options.removeprefix("size=") if m.options.startswith("size=") else None
            entry: dict = {"type": "tmpfs", "target": m.target}
            if size:
                from .settings import parse_size

                entry["tmpfs"] = {"size": parse_size(size)}
            out.append(entry)
            continue
        source = _esc(m.source)
        if m.kind == "bind" and m.source == hf_cache:  # the one place the file interpolates on purpose
            source = "${HF_CACHE:-" + _esc(hf_cache) + "}"
        if m.kind == "volume":
            named[m.source] = {"name": m.source}  # the volume flash serve uses, not a project-prefixed copy
        entry = {"type": m.kind, "source": source, "target": m.target}
        if m.read_only:
            entry["read_only"] = True
        out.append(entry)
    return out, named


def _service(spec: RunSpec, hf_cache: str) -> tuple[dict, dict]:
    volumes, named = _volumes(spec, hf_cache)
    env = _esc(dict(spec.env))
    svc: dict = {"image": spec.image, "container_name": spec.name, "entrypoint": _esc(list(spec.entrypoint)),
                 "command": _esc(list(spec.command)), "restart": spec.restart + (":3" if spec.restart == "on-failure" else "")}
    if spec.needs_api_key:
        env["FLASH_API_KEY_FILE"] = SECRET_TARGET  # the path; the launcher reads the key from it
        svc["secrets"] = [SECRET]
    svc["environment"] = env
    svc["labels"] = _esc(dict(spec.labels))
    if spec.network == "host":
        svc["network_mode"] = "host"
    else:
        svc["ports"] = [f"{bind}:{port}:{target.split('/')[0]}" for target, (bind, port) in spec.ports.items()]
    if volumes:
        svc["volumes"] = volumes
    svc["ipc"] = spec.ipc
    svc["shm_size"] = spec.shm_size
    if spec.cpuset:
        svc["cpuset"] = spec.cpuset
    if spec.gpus:
        dev: dict = {"driver": "nvidia", "capabilities": ["gpu"]}
        if spec.gpu_ids:
            dev["device_ids"] = list(spec.gpu_ids)
        else:
            dev["count"] = "all"
        svc["deploy"] = {"resources": {"reservations": {"devices": [dev]}}}
    svc["logging"] = {"driver": "json-file", "options": {"max-size": spec.log_max_size, "max-file": str(spec.log_max_files)}}
    hc = spec.healthcheck
    if hc.get("test") == ["NONE"]:
        svc["healthcheck"] = {"disable": True}
    else:
        svc["healthcheck"] = {"test": _esc(list(hc["test"])), "interval": _duration(hc["interval"]),
                              "timeout": _duration(hc["timeout"]), "retries": hc["retries"],
                              "start_period": _duration(hc["start_period"])}
    return svc, named


def compose(spec: RunSpec, settings, hf_cache: str, guard: bool = True) -> dict:
    """The compose document (a dict; `compose_text` renders it)."""
    server, named = _service(spec, hf_cache)
    doc: dict = {"services": {"server": server}}
    if guard:
        g, _ = _service(guard_spec(settings, spec.name, spec.image, spec.restart), hf_cache)
        g["depends_on"] = ["server"]
        doc["services"]["guard"] = g
    if named:
        doc["volumes"] = named
    if spec.needs_api_key:
        doc["secrets"] = {SECRET: {"file": "${FLASH_API_KEY_FILE:-" + KEY_FILE_DEFAULT + "}"}}
    return doc


def compose_text(doc: dict, header: list[str]) -> str:
    import yaml

    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1_000_000, allow_unicode=True)
    return "".join(f"# {h}\n" if h else "#\n" for h in header) + body


def header_lines(spec: RunSpec, profile: str, settings) -> list[str]:
    lines = [f"flash profile '{profile}' as `flash serve` runs it (flash export compose); settings {spec.labels.get('org.flash.settings', '')}",
             f"start: docker compose up -d   (Compose v1: docker-compose up -d); API {spec.api_url}/v1",
             f"image: {spec.image} is built from the flash repository (flash setup) or loaded with docker load;",
             "  no registry carries it.",
             "weights: the HF cache holding the snapshot in the command (HF_CACHE=/path overrides the path below)."]
    if spec.needs_api_key:
        lines += ["API key: a file, never in this file or the environment. Create it before the first start:",
                  f"  (umask 077; openssl rand -hex 32 > {KEY_FILE_DEFAULT})   or FLASH_API_KEY_FILE=/path/to/key",
                  "  clients send it as: Authorization: Bearer $(cat flash-api-key)"]
    if settings["GUARD"]:
        lines += ["guard: the memory watchdog (docs/GUARD.md) stops the server through the Docker socket when",
                  f"  PSI full avg10 stays above {settings['GUARD_PSI_FULL']:g}% for {settings['GUARD_HOLD']} s; its log says why."]
    return lines


__all__ = ["compose", "compose_text", "header_lines", "GUARD_LABEL"]
