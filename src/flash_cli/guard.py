"""The memory guard's two halves as plain data (issue 36); serve and status execute them.

Before a start: the memory `flash plan` says the recipe will claim, plus GUARD_MARGIN, against
MemAvailable. MemAvailable is the kernel's own estimate of what can be allocated without
swapping: free memory plus the page cache and reclaimable slab it can drop (minus the low
watermarks). So it is compared as it is; adding Cached or SReclaimable on top would count the
reclaimable page cache twice, and using MemFree would count it not at all (a box that just read
a 125 GiB checkpoint has little MemFree but plenty available).

While serving: a sidecar container NAME-guard runs `python3 -m flash_common.memguard` from the
server's own image, with the Engine socket (to stop the server as `docker stop` does) and the
host's cgroup tree read-only (GUARD_SOURCE=container). It carries org.flash.guard=NAME, never
org.flash.name, so nothing that finds the server by label can pick it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .errors import MemoryLow
from .spec import LABEL, Mount, RunSpec

GIB = 1024**3
GUARD_LABEL = f"{LABEL}.guard"
EVENT = "flash-guard-event"  # flash_common.memguard.EVENT (not imported: status must stay light)
SOCKET = "/var/run/docker.sock"
CGROUP_TARGET = "/host/sys/fs/cgroup"


def guard_name(name: str) -> str:
    return f"{name}-guard"


# -- before a start -------------------------------------------------------------------------
@dataclass
class MemoryCheck:
    ok: bool
    available: int | None  # MemAvailable, bytes (None: not known here)
    need: int | None  # what the plan says the recipe claims on this box, bytes
    margin: int
    text: str

    def as_dict(self) -> dict:
        return {"ok": self.ok, "available_gib": _gib(self.available), "need_gib": _gib(self.need),
                "margin_gib": _gib(self.margin), "text": self.text}


def _gib(x: int | None) -> float | None:
    return None if x is None else round(x / GIB, 2)


def planned_need(plan: dict) -> int | None:
    """Bytes the recipe takes from the host pool on unified memory: vLLM's claim (GPU_MEM × the
    device total, or weights + KV_CACHE_MEM) plus its processes before the first memory snapshot.
    None on a discrete GPU (the budget is device memory, not MemAvailable)."""
    host = plan.get("host") or {}
    if not host.get("unified_memory") or host.get("vllm_claim_gib") is None:
        return None
    return int((host["vllm_claim_gib"] + (host.get("vllm_pre_snapshot_gib") or 0)) * GIB)


def check_memory(need: int | None, meminfo: dict[str, int], margin: int, hardware: str) -> MemoryCheck:
    avail = meminfo.get("MemAvailable")
    if need is None:
        return MemoryCheck(True, avail, None, margin, f"memory check skipped: the plan ({hardware}) has no claim on "
                           "the host pool (discrete GPU, or no unified-memory box detected here)")
    if avail is None:
        return MemoryCheck(True, None, need, margin, "memory check skipped: no MemAvailable in /proc/meminfo")
    want = need + margin
    text = (f"MemAvailable {avail / GIB:.1f} GiB (free memory plus the page cache the kernel can drop) vs "
            f"{want / GIB:.1f} GiB = the plan's {need / GIB:.1f} GiB for this recipe + GUARD_MARGIN "
            f"{margin / GIB:.1f} GiB")
    return MemoryCheck(avail >= want, avail, need, margin, text)


def memory_low(c: MemoryCheck, waited: float | None = None) -> MemoryLow:
    short = (c.need or 0) + c.margin - (c.available or 0)
    return MemoryLow(f"not enough memory to start: {c.text}; {short / GIB:.1f} GiB short"
                     + (f" after waiting {waited:.0f} s" if waited is not None else ""),
                     hint="free memory (other containers, a desktop session, a large cache-holding job), lower "
                          "GPU_MEM, or wait for it: flash serve --wait-memory [SECONDS] (GUARD_WAIT=SECONDS)")


def wait_for_memory(check: Callable[[], MemoryCheck], timeout: float, interval: float = 5.0,
                    clock=time.monotonic, sleep=time.sleep, progress=None) -> MemoryCheck:
    """Poll `check` until it passes; raise MemoryLow with the last numbers after `timeout` s."""
    start = clock()
    c = check()
    while not c.ok:
        waited = clock() - start
        if waited >= timeout:
            raise memory_low(c, waited)
        if progress:
            progress(c, waited)
        sleep(min(interval, max(timeout - waited, 0.1)))
        c = check()
    return c


# -- while serving: the sidecar -------------------------------------------------------------
def guard_args(s, name: str) -> list[str]:
    argv = ["python3", "-m", "flash_common.memguard", "--name", name, "--source", s["GUARD_SOURCE"],
            "--threshold", f"{s['GUARD_PSI_FULL']:g}", "--hold", str(s["GUARD_HOLD"]),
            "--interval", "2", "--grace", str(s["GUARD_GRACE"]), "--cgroup-root", CGROUP_TARGET]
    if s["GUARD_PORT"]:
        argv += ["--metrics", f"127.0.0.1:{s['GUARD_PORT']}"]
    return argv


def engine_socket(env: dict[str, str]) -> str:
    """The host path of the Engine socket the server was started through (DOCKER_HOST unix://…,
    e.g. rootless Docker), which the guard must stop it through."""
    host = env.get("DOCKER_HOST") or ""
    return host[len("unix://"):] if host.startswith("unix://") else SOCKET


def guard_spec(s, name: str, image: str, restart: str, socket: str = SOCKET) -> RunSpec:
    """The sidecar beside the server NAME: its image, host network (its /metrics on loopback only),
    no GPU, a tiny shm, the server's restart policy (after a reboot they come back together)."""
    labels = {GUARD_LABEL: name, f"{LABEL}.image": image, f"{LABEL}.role": "guard",
              f"{LABEL}.guard-port": str(s["GUARD_PORT"])}
    mounts = [Mount("bind", SOCKET, socket),  # stop = the Engine API's stop, so unless-stopped stays stopped
              Mount("bind", CGROUP_TARGET, "/sys/fs/cgroup", read_only=True)]
    return RunSpec(
        name=guard_name(name), image=image, entrypoint=["python3"], command=guard_args(s, name)[1:],
        env={"PYTHONUNBUFFERED": "1"}, labels=labels, mounts=mounts, network="host", ports={},
        restart=restart, gpus=False, ipc="private", shm_size=64 * 1024**2,
        log_max_size="10m", log_max_files=2, cpuset=None, healthcheck={"test": ["NONE"]},
        api_url="", warnings=[])


def last_event(lines: list[str]) -> dict | None:
    """The guard's last `flash-guard-event {json}` record in its log lines."""
    import json

    for line in reversed(lines):
        head, _, rest = line.partition(f"{EVENT} ")
        if rest and (not head or head.endswith(" ")):
            try:
                return json.loads(rest)
            except ValueError:
                continue
    return None


# -- the Docker side (the client is docker-py's; nothing imported here) -----------------------
def find_sidecar(client, name: str):
    found = client.containers.list(all=True, filters={"label": f"{GUARD_LABEL}={name}"})
    return found[0] if found else None


def remove_sidecar(client, name: str) -> bool:
    c = find_sidecar(client, name)
    if c is None:
        return False
    c.remove(force=True)
    return True


def start_sidecar(client, spec: RunSpec):
    """Replace NAME's guard with one from `spec` (the server's image may have changed)."""
    from . import engine

    remove_sidecar(client, spec.labels[GUARD_LABEL])
    return engine.create_and_start(client, spec)


def memory_checker(s, hw=None, read_meminfo=None) -> Callable[[], MemoryCheck]:
    """The check for this machine: plan once on the detected hardware, then each call reads
    /proc/meminfo again (what --wait-memory polls)."""
    from . import mempressure
    from .plan import build, hardware

    if hw is None:
        hw, _ = hardware.detect()
    read = read_meminfo or mempressure.read_meminfo
    margin = s["GUARD_MARGIN"]
    if not (hw.unified and hw.detected):
        text = (f"memory check skipped: planned for {hw.name}" + ("" if hw.detected else " (not detected here)")
                + ("" if hw.unified else "; its GPU memory is not the host's"))
        return lambda: MemoryCheck(True, read().get("MemAvailable"), None, margin, text)
    need = planned_need(build(s, hw, live_checks=False))
    return lambda: check_memory(need, read(), margin, hw.name)
