"""RunSpec → docker-py keyword arguments, and → the equivalent `docker run` line.

Both renderings come from the same RunSpec, so what `--dry-run` prints is what `serve` runs.
docker-py is imported lazily (only `to_kwargs` with real types needs it).
"""

from __future__ import annotations

import shlex

from .spec import RunSpec


def to_kwargs(spec: RunSpec) -> dict:
    """Arguments for `client.containers.create(**kwargs)` (docker-py 7.x names)."""
    from docker.types import DeviceRequest, LogConfig, Mount as DMount

    mounts = []
    for m in spec.mounts:
        if m.kind == "tmpfs":
            size = m.options.removeprefix("size=") if m.options.startswith("size=") else None
            mounts.append(DMount(m.target, None, type="tmpfs", tmpfs_size=size))
        else:
            mounts.append(DMount(m.target, m.source, type=m.kind, read_only=m.read_only,
                                 propagation=m.propagation or None))
    kwargs: dict = {
        "image": spec.image,
        "name": spec.name,
        "command": spec.command,
        "environment": spec.env,
        "labels": spec.labels,
        "mounts": mounts,
        "restart_policy": {"Name": spec.restart} if spec.restart != "on-failure"
        else {"Name": "on-failure", "MaximumRetryCount": 3},
        "log_config": LogConfig(type="json-file", config={"max-size": spec.log_max_size,
                                                           "max-file": str(spec.log_max_files)}),
        "detach": True,
    }
    # empty = the image's own (a helper container's entrypoint and healthcheck, Docker's ipc/shm)
    for key, value in (("entrypoint", spec.entrypoint), ("ipc_mode", spec.ipc), ("shm_size", spec.shm_size),
                       ("healthcheck", spec.healthcheck), ("pid_mode", spec.pid_mode), ("user", spec.user)):
        if value:
            kwargs[key] = value
    if spec.network == "host":
        kwargs["network_mode"] = "host"
    else:
        kwargs["ports"] = dict(spec.ports)
    if spec.gpus and spec.gpu_ids:
        kwargs["device_requests"] = [DeviceRequest(device_ids=list(spec.gpu_ids), capabilities=[["gpu"]])]
    elif spec.gpus:
        kwargs["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    if spec.cpuset:
        kwargs["cpuset_cpus"] = spec.cpuset
    if spec.devices:
        kwargs["devices"] = [f"{d}:{d}:rwm" for d in spec.devices]
    if spec.cap_add:
        kwargs["cap_add"] = list(spec.cap_add)
    if spec.ulimits:
        from docker.types import Ulimit

        kwargs["ulimits"] = [Ulimit(name=n, soft=soft, hard=hard) for n, soft, hard in spec.ulimits]
    if spec.healthcheck.get("test") == ["NONE"]:
        kwargs["healthcheck"] = {"test": ["NONE"]}
    return kwargs


def to_docker_run(spec: RunSpec) -> list[str]:
    """The same container as a `docker run` argv (for --dry-run, docs and golden files)."""
    argv = ["docker", "run", "-d", "--name", spec.name, "--restart",
            spec.restart + (":3" if spec.restart == "on-failure" else "")]
    if spec.gpus:
        argv += ["--gpus", f'"device={",".join(spec.gpu_ids)}"' if spec.gpu_ids else "all"]
    if spec.ipc:
        argv += ["--ipc", spec.ipc]
    if spec.shm_size:
        argv += ["--shm-size", str(spec.shm_size)]
    if spec.pid_mode:
        argv += ["--pid", spec.pid_mode]
    if spec.user:
        argv += ["--user", spec.user]
    for d in spec.devices:
        argv += ["--device", d]
    for cap in spec.cap_add:
        argv += ["--cap-add", cap]
    for n, soft, hard in spec.ulimits:
        argv += ["--ulimit", f"{n}={soft}:{hard}"]
    if spec.network == "host":
        argv += ["--network", "host"]
    for target, (bind, port) in spec.ports.items():
        argv += ["-p", f"{bind}:{port}:{target.split('/')[0]}"]
    if spec.cpuset:
        argv += ["--cpuset-cpus", spec.cpuset]
    argv += ["--log-opt", f"max-size={spec.log_max_size}", "--log-opt", f"max-file={spec.log_max_files}"]
    for m in spec.mounts:
        if m.kind == "tmpfs":
            argv += ["--tmpfs", f"{m.target}:rw,{m.options}" if m.options else m.target]
        else:
            opt = f"type={m.kind},source={m.source},target={m.target}" + (",readonly" if m.read_only else "")
            if m.propagation:
                opt += f",bind-propagation={m.propagation}"
            argv += ["--mount", opt]
    for k, v in spec.env.items():
        argv += ["-e", f"{k}={v}"]
    for k, v in spec.labels.items():
        argv += ["--label", f"{k}={v}"]
    hc = spec.healthcheck
    if hc.get("test") == ["NONE"]:
        argv += ["--no-healthcheck"]
    elif hc:
        argv += ["--health-cmd", shlex.join(hc["test"][1:]), "--health-interval", f"{hc['interval'] // 10**9}s",
                 "--health-timeout", f"{hc['timeout'] // 10**9}s", "--health-retries", str(hc["retries"]),
                 "--health-start-period", f"{hc['start_period'] // 10**9}s"]
    if spec.entrypoint:
        argv += ["--entrypoint", spec.entrypoint[0], spec.image, *spec.entrypoint[1:], *spec.command]
    else:
        argv += [spec.image, *spec.command]
    return argv


def docker_run_text(spec: RunSpec) -> str:
    """One copy-pasteable command, wrapped (backslash-newline) before each flag for reading:
    docker's flags first, then the image line, then one `vllm serve` flag per line."""
    argv = [shlex.quote(t) for t in to_docker_run(spec)]
    head = 3 + len(spec.entrypoint) - 1 + 3  # --entrypoint X IMAGE <entrypoint args> vllm serve PATH
    start = len(argv) - len(spec.command) - len(spec.entrypoint) - 2
    flags, tail = argv[:start], argv[start:]
    groups: list[list[str]] = [flags[:2]]
    for tok in flags[2:]:
        if tok.startswith("-"):
            groups.append([])
        groups[-1].append(tok)
    groups.append(tail[: head])
    for tok in tail[head:]:
        if tok.startswith("-"):
            groups.append([])
        groups[-1].append(tok)
    return " \\\n  ".join(" ".join(g) for g in groups)
