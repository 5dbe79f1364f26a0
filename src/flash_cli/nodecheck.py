"""`flash doctor` for a multi-node deployment: every box through its own Docker Engine.

Per box: reachable; kernel not on the known-bad list (data/known_bad_kernels.json); clock within
a second of this machine (and so of the other boxes); the image present and the SAME image on
every box; then a short probe container of that image, started with the deployment's own RDMA
options, reports what a rank will see: /dev/infiniband passed, memlock unlimited, IPC_LOCK in its
capabilities, the fast link's state and rate, the checkpoint revision and prepared variant, user
lingering / RemoveIPC, and (a box whose server needs the API key: pd beyond loopback) the key file at
the path its container mounts. With the deployment running: NCCL's transport read from each rank's log
(sockets instead of IB fails the tp/pp layouts). Facts are gathered into plain dicts (`facts`) and judged
by pure functions (`judge`), which the unit tier tests without engines.
"""

from __future__ import annotations

import json
import re
import time
from importlib import resources

from . import engine
from .spec import HF_MOUNT, LABEL

NCCL_IB = re.compile(r"NET/IB\b|via NET/IB|NET/GDR|GPU Direct RDMA")
NCCL_SOCKET = re.compile(r"NET/Socket\b|via NET/Socket")

# Runs inside the image (python3 only, stdlib); prints one JSON line.
PROBE = r'''
import json, os, resource, sys
model, revision, suffix = sys.argv[1], sys.argv[2], sys.argv[3]
key_file = sys.argv[4] if len(sys.argv) > 4 else ""
out = {}
out["key_file"] = None if not key_file else os.path.isfile("/host" + key_file) and os.path.getsize("/host" + key_file) > 0
soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
out["memlock_unlimited"] = soft == resource.RLIM_INFINITY and hard == resource.RLIM_INFINITY
out["memlock"] = [soft, hard]
capeff = 0
for line in open("/proc/self/status"):
    if line.startswith("CapEff:"):
        capeff = int(line.split()[1], 16)
out["ipc_lock"] = bool(capeff & (1 << 14))
out["infiniband"] = sorted(os.listdir("/dev/infiniband")) if os.path.isdir("/dev/infiniband") else None
ports = []
base = "/sys/class/infiniband"
for dev in sorted(os.listdir(base)) if os.path.isdir(base) else []:
    pdir = os.path.join(base, dev, "ports")
    for p in sorted(os.listdir(pdir)) if os.path.isdir(pdir) else []:
        def rd(n):
            try:
                return open(os.path.join(pdir, p, n)).read().strip()
            except OSError:
                return ""
        ports.append({"dev": dev, "port": p, "state": rd("state"), "rate": rd("rate"), "link_layer": rd("link_layer")})
out["ib_ports"] = ports
repo = "/hf/hub/models--" + model.replace("/", "--")
ref = revision
if not ref:
    try:
        ref = open(repo + "/refs/main").read().strip()
    except OSError:
        ref = ""
out["revision"] = ref
snap = repo + "/snapshots/" + ref if ref else ""
out["snapshot"] = bool(snap) and os.path.isdir(snap)
variant = snap + suffix if snap else ""
out["variant"] = bool(variant) and os.path.isdir(variant)
marker = os.path.join(variant, ".prepared") if variant else ""
try:
    out["variant_marker"] = json.load(open(marker)) if suffix and marker else None
except (OSError, ValueError):
    out["variant_marker"] = None
lingering = "/host/var/lib/systemd/linger"
out["lingering"] = sorted(os.listdir(lingering)) if os.path.isdir(lingering) else []
removeipc = None
for path in ("/host/etc/systemd/logind.conf",):
    try:
        for line in open(path):
            line = line.strip()
            if line.startswith("RemoveIPC="):
                removeipc = line.split("=", 1)[1].strip().lower()
    except OSError:
        pass
out["remove_ipc"] = removeipc
print(json.dumps(out))
'''


def known_bad_kernels() -> list[dict]:
    text = resources.files("flash_cli").joinpath("data/known_bad_kernels.json").read_text()
    return json.loads(text)["kernels"]


def bad_kernel(release: str) -> dict | None:
    return next((k for k in known_bad_kernels() if release.startswith(k["prefix"])), None)


def ssh_user(box: str) -> str | None:
    rest = box.split("://", 1)[-1]
    return rest.split("@", 1)[0] if "@" in rest else None


def facts(node, settings, image: str, timeout: int = 60) -> dict:
    """Everything doctor judges about one box, gathered through its engine (no ssh of our own)."""
    import getpass

    from docker.errors import APIError, ContainerError, ImageNotFound

    from . import deploy, render
    from .hfcache import VARIANT_SUFFIX
    from .errors import DockerUnavailable

    f: dict = {"node": node.index, "box": node.box, "engine": node.engine or "local"}
    try:
        before = time.time()
        client = deploy.connect(node.engine, node.box, node.index, timeout=timeout)
        info = client.info()
        after = time.time()
    except DockerUnavailable as exc:
        f["unreachable"] = str(exc)
        return f
    f["kernel"] = info.get("KernelVersion", "")
    remote = engine.epoch(info.get("SystemTime", ""))
    f["clock_offset_s"] = None if remote is None else remote - (before + after) / 2
    f["clock_rtt_s"] = after - before
    f["user"] = ssh_user(node.box) or getpass.getuser()
    try:
        img = client.images.get(image)
        f["image_id"], f["image_labels"] = img.id, img.labels or {}
        f["image_digests"] = img.attrs.get("RepoDigests") or []
    except ImageNotFound:
        f["image_id"] = None
        return f
    spec = node.spec
    kwargs = dict(image=image, entrypoint=["python3", "-c", PROBE],
                  command=[settings["MODEL"], settings["REVISION"] or "", VARIANT_SUFFIX[settings["MODE"]],
                           spec.key_file if spec.needs_api_key else ""],
                  network_mode="host", remove=True, detach=False, stdout=True, stderr=False,
                  mounts=[m for m in render.to_kwargs(spec)["mounts"] if m["Target"] == HF_MOUNT],
                  volumes={"/": {"bind": "/host", "mode": "ro"}}, labels={f"{LABEL}.probe": "doctor"})
    rdma = {k: v for k, v in render.to_kwargs(spec).items() if k in ("devices", "cap_add", "ulimits")}
    try:
        raw = client.containers.run(**kwargs, **rdma)
        f["rdma_options_accepted"] = bool(rdma)
    except (APIError, ContainerError) as exc:
        if not rdma:
            f["probe_error"] = str(exc).splitlines()[0][:300]
            return f
        f["rdma_options_accepted"] = False
        f["rdma_error"] = str(exc).splitlines()[0][:300]
        try:  # the other facts still count
            raw = client.containers.run(**kwargs)
        except (APIError, ContainerError) as exc2:
            f["probe_error"] = str(exc2).splitlines()[0][:300]
            return f
    f["probe"] = json.loads(raw.decode().strip().splitlines()[-1])
    f["key_path"] = spec.key_file if spec.needs_api_key else ""
    c = deploy.find_node(client, settings["NAME"], node.index)
    if c is not None:
        c.reload()
        f["container"] = {"state": c.attrs.get("State", {}).get("Status"), "image_id": c.attrs.get("Image")}
        logs = c.logs(tail=5000).decode("utf-8", "replace")
        f["nccl"] = "ib" if NCCL_IB.search(logs) else "socket" if NCCL_SOCKET.search(logs) else None
    return f


def judge(all_facts: list[dict], settings) -> list[tuple[str, str]]:
    """(level, text) per finding: pure, so the unit tier pins every rule."""
    out: list[tuple[str, str]] = []
    from . import layout

    rdma, gbps = settings["RDMA"], settings["LINK_GBPS"]
    lay = layout.of(settings)
    coupled = lay is not None and lay.rendezvous  # one model over the boxes: every step waits on the link
    reach = [f for f in all_facts if "unreachable" not in f]
    for f in all_facts:
        where = f"node {f['node']} ({f['box']})"
        if "unreachable" in f:
            out.append(("fail", f"{where}: unreachable: {f['unreachable']}"))
            continue
        out.append(("ok", f"{where}: Docker Engine reachable at {f['engine']}"))
        bad = bad_kernel(f.get("kernel", ""))
        out.append(("fail", f"{where}: kernel {f['kernel']} is known bad: {bad['why']} ({bad['source']})") if bad
                   else ("ok", f"{where}: kernel {f.get('kernel')}"))
        off = f.get("clock_offset_s")
        if off is None:
            out.append(("warn", f"{where}: clock not readable from docker info"))
        elif abs(off) > engine.CLOCK_SKEW_S + f.get("clock_rtt_s", 0):
            out.append(("fail", f"{where}: clock {off:+.2f} s off this machine's (more than {engine.CLOCK_SKEW_S:.0f} s): "
                                "enable NTP (timedatectl set-ntp true)"))
        else:
            out.append(("ok", f"{where}: clock within {abs(off):.2f} s"))
        if f.get("image_id") is None:
            out.append(("fail", f"{where}: image {settings['IMAGE'] or 'flash-vllm:' + settings['BASE']} is not there: "
                                "flash setup on that box (or docker save | docker -H … load)"))
            continue
        if "probe_error" in f:
            out.append(("fail", f"{where}: probe container failed: {f['probe_error']}"))
            continue
        p = f.get("probe", {})
        if rdma:
            if not f.get("rdma_options_accepted"):
                out.append(("fail", f"{where}: the RDMA options do not start a container ({f.get('rdma_error', '?')}): "
                                    "/dev/infiniband missing? (MLNX/DOCA OFED drivers, rdma-core)"))
            else:
                for ok, text in ((bool(p.get("infiniband")), f"/dev/infiniband passed ({', '.join(p.get('infiniband') or [])})"),
                                 (p.get("memlock_unlimited"), "memlock unlimited"),
                                 (p.get("ipc_lock"), "IPC_LOCK")):
                    out.append(("ok" if ok else "fail", f"{where}: {text}" if ok else f"{where}: NOT {text}"))
            active = [x for x in p.get("ib_ports", []) if "ACTIVE" in x.get("state", "")]
            rates = [int(m.group(1)) for x in active for m in [re.match(r"(\d+)", x.get("rate", ""))] if m]
            if not active:
                out.append(("fail", f"{where}: no active RDMA port (cable? link down?)"))
            elif max(rates, default=0) < gbps:
                out.append(("fail", f"{where}: link at {max(rates, default=0)} Gb/s, expected {gbps} (LINK_GBPS)"))
            else:
                out.append(("ok", f"{where}: link up at {max(rates)} Gb/s"))
        else:
            out.append(("warn", f"{where}: RDMA=0: /dev/infiniband, memlock and IPC_LOCK not checked (NCCL over TCP)"))
        if not p.get("snapshot"):
            out.append(("fail", f"{where}: checkpoint {settings['MODEL']} revision {p.get('revision') or '?'} not in HF_CACHE "
                                f"there ({settings['HF_CACHE']} must be the same path on every box)"))
        elif settings["MODE"] != "nvfp4" and not p.get("variant"):
            out.append(("fail", f"{where}: the {settings['MODE']} variant is not prepared there (flash prepare on that box)"))
        if p.get("key_file") is False:
            out.append(("fail", f"{where}: the API key file {f.get('key_path')} is not there (its container mounts it; "
                                "docker refuses a missing bind source): copy it from this machine (mode 0600)"))
        elif p.get("key_file"):
            out.append(("ok", f"{where}: API key file present"))
        user = f.get("user")
        if user == "root" or p.get("remove_ipc") == "no" or user in p.get("lingering", []):
            out.append(("ok", f"{where}: shared memory survives logout (" + ("root" if user == "root" else
                        "RemoveIPC=no" if p.get("remove_ipc") == "no" else f"{user} lingers") + ")"))
        else:
            out.append(("warn", f"{where}: user {user} does not linger and RemoveIPC is not 'no': logind deletes the "
                                f"ranks' shared memory when the session ends: sudo loginctl enable-linger {user}"))
        if f.get("nccl") == "socket" and coupled:
            out.append(("fail", f"{where}: NCCL fell back to sockets (NET/Socket in the log): about half the link's "
                                "speed; pass the RDMA devices (RDMA=1) and check /dev/infiniband"))
        elif f.get("nccl") == "ib":
            out.append(("ok", f"{where}: NCCL over IB/RDMA"))
        elif f.get("nccl") == "socket":
            out.append(("warn", f"{where}: NCCL over sockets"))
    ids = {f.get("image_id") for f in reach if f.get("image_id")}
    if len(ids) > 1:
        detail = ", ".join(f"node {f['node']} {str(f.get('image_id'))[7:19]}" for f in reach if f.get("image_id"))
        out.append(("fail", f"the boxes run different images ({detail}): build or load the same image everywhere"))
    elif ids:
        out.append(("ok", f"same image on every box ({next(iter(ids))[7:19]})"))
    revs = {f.get("probe", {}).get("revision") for f in reach if f.get("probe")}
    if len(revs) > 1:
        out.append(("fail", f"the boxes hold different checkpoint revisions ({', '.join(sorted(str(r) for r in revs))}): "
                            "pin REVISION= and download it on every box"))
    marks = {json.dumps(f["probe"].get("variant_marker"), sort_keys=True) for f in reach
             if f.get("probe") and f["probe"].get("variant_marker") is not None}
    if len(marks) > 1:
        out.append(("fail", "the prepared variants differ between the boxes (.prepared markers): flash prepare again"))
    return out
