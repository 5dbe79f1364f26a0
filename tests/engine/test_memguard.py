"""Engine tier: the memory guard against a real cgroup memory limit (issue 36).

A container under a 128 MiB limit (no swap) fills its anonymous memory to within ~56 MiB of the
limit, then walks a 64 MiB file over and over: every pass evicts and refaults its own pages, so
its cgroup's PSI `full` rises and stays up (it never reaches the OOM killer). The guard sidecar,
built by the same code `flash serve` uses, reads that cgroup's memory.pressure through the host's
cgroup tree and stops the container through the Engine socket. A bystander keeps running.

The cgroup's memory.pressure must exist: cgroup v2 (or a hybrid host's unified tree, where Docker's
cgroupfs driver also places every container) with PSI on. Where it does not, the test fails and
says so; it never skips.
"""

from __future__ import annotations

import glob
import os
import json
import time
import urllib.request
from pathlib import Path

import pytest

from flash_cli import guard
from flash_cli.settings import resolve

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
BASE = "flash-test-base:bookworm"  # tests/engine/conftest.py's, from tests/support/standin_base.sh

LIMIT_MIB = 128
PRESSURE = f"""
import mmap, os, sys, time
path = "/tmp/ws"
with open(path, "wb") as f:
    f.write(os.urandom(64 << 20))
hold = [bytearray(1 << 20) for _ in range({LIMIT_MIB} - 56)]
m = mmap.mmap(os.open(path, os.O_RDONLY), 0, prot=mmap.PROT_READ)
print("allocated; thrashing", flush=True)
t0 = time.time()
while True:
    s = sum(m[off] for off in range(0, len(m), 4096))
    print("pass", round(time.time() - t0, 1), flush=True)
"""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pressure_file(cid: str) -> str | None:
    hits = [p for pat in guard_patterns() for p in glob.glob(pat.format(root="/sys/fs/cgroup", id=cid))]
    return hits[0] if hits else None


def guard_patterns():
    from flash_common.memguard import CGROUP_PATTERNS

    return CGROUP_PATTERNS


def wait_for(pred, timeout: float, every: float = 1.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    return None


@pytest.fixture(scope="module")
def guard_image(docker_client, tmp_path_factory):
    """The test base plus flash_common where the image's installer puts it (a tag of our own: the
    shared engine's flash-vllm:enginetest is rebuilt by other sessions' fixtures)."""
    import shutil
    import subprocess

    subprocess.run([str(ROOT / "tests" / "support" / "standin_base.sh"), BASE], check=True)
    ctx = tmp_path_factory.mktemp("guard-ctx")
    shutil.copytree(ROOT / "src" / "flash_common", ctx / "flash_common", ignore=shutil.ignore_patterns("__pycache__"))
    (ctx / "Dockerfile").write_text(f"FROM {BASE}\nCOPY flash_common /opt/flash/lib/flash_common\n"
                                    "ENV PYTHONPATH=/opt/flash/lib\nLABEL org.flash.test=guard\n")
    tag = "flash-guardtest:engine"
    docker_client.images.build(path=str(ctx), tag=tag, rm=True)
    return tag


def test_guard_stops_a_container_under_real_memory_pressure_and_nothing_else(docker_client, guard_image):
    from flash_cli.engine import state
    from prometheus_client.parser import text_string_to_metric_families

    name = f"flash-memtest-{int(time.time())}"
    port = free_port()
    made = []
    try:
        server = docker_client.containers.run(
            guard_image, ["python3", "-c", PRESSURE], name=name, detach=True, labels={"org.flash.name": name},
            mem_limit=f"{LIMIT_MIB}m", memswap_limit=f"{LIMIT_MIB}m", restart_policy={"Name": "unless-stopped"},
            network_mode="none")
        made.append(server)
        bystander = docker_client.containers.run(guard_image, ["sleep", "600"], name=f"{name}-bystander",
                                                 detach=True, labels={"org.flash.test": "bystander"}, network_mode="none")
        made.append(bystander)
        server.reload()
        path = wait_for(lambda: pressure_file(server.id), 10)
        assert path, ("no memory.pressure for the container under /sys/fs/cgroup (looked for "
                      f"{[p.format(root='/sys/fs/cgroup', id=server.id[:12] + '…') for p in guard_patterns()]}): this host "
                      "has no cgroup v2 tree with PSI where Docker puts containers, so pressure cannot be "
                      "measured per container here (kernel psi=0 or cgroup_disable=pressure?)")
        s = resolve(overrides={"GUARD_SOURCE": "container", "GUARD_PSI_FULL": "10", "GUARD_HOLD": "6",
                               "GUARD_GRACE": "5", "GUARD_PORT": str(port), "RESTART": "unless-stopped"})
        g = guard.start_sidecar(docker_client, guard.guard_spec(s, name, guard_image, "unless-stopped"))
        made.append(g)
        # the pressure is real and measured where the guard reads it
        seen = []

        def high():
            with open(path) as fh:
                full = float(fh.read().split("full avg10=")[1].split()[0])
            seen.append(full)
            return full > 10

        assert wait_for(high, 90, 2), f"PSI full avg10 of the container never rose above 10%: {seen}"
        assert wait_for(lambda: state(server).status == "exited", 120, 2), \
            "the guard did not stop the container:\n" + g.logs().decode()[-2000:]
        st = server.attrs["State"]
        assert not st["OOMKilled"], "the kernel's OOM killer got there first"
        assert st["ExitCode"] in (143, 137), st  # SIGTERM (or SIGKILL after the grace period)
        log = g.logs().decode()
        assert f"STOPPING memory pressure: PSI full avg10" in log, log
        events = [json.loads(ln.split("flash-guard-event ", 1)[1]) for ln in log.splitlines() if "flash-guard-event " in ln]
        stop = [e for e in events if e["event"] == "stopping"]
        assert stop and stop[0]["psi_full_avg10"] > 10 and stop[0]["above_s"] >= 6 and stop[0]["source"] == "container"
        assert events[-1]["event"] == "stopped"
        print("guard stop event:", json.dumps(stop[0]))
        # docker stop (not a kill from inside): unless-stopped does not bring it back
        time.sleep(5)
        assert state(server).status == "exited"
        # nothing else was touched: the bystander and the guard itself still run
        assert state(bystander).status == "running"
        assert state(g).status == "running"
        # the reason is exported
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert fams["flash_guard_stops"].samples[0].value == 1
        last = fams["flash_guard_last_stop_timestamp_seconds"].samples[0]
        assert "PSI full avg10" in last.labels["reason"] and last.labels["name"] == name
        # and `flash status` says why (read from the guard's log)
        from flash_cli.commands.status import collect

        info = collect(name)
        assert info["state"] == "exited" and info["guard"]["stopped_server"], info["guard"]
        assert "stayed above 10%" in info["guard"]["reason"]
    finally:
        for c in made:
            c.remove(force=True)


def test_serve_starts_the_guard_beside_the_server_and_rm_removes_it(flash, docker_client):
    """The sidecar `flash serve` starts from the RunSpec, in the server's own image (flash_common
    installed by the Dockerfile's installer), armed on the server; status shows it; rm takes it."""
    res = flash("serve", "published", "--start-check", "2", f"GUARD_PORT={free_port()}")
    assert res.returncode == 0, res.stderr
    assert f"memory guard {flash.name}-guard" in res.stderr
    g = docker_client.containers.get(f"{flash.name}-guard")
    assert g.labels["org.flash.guard"] == flash.name and "org.flash.name" not in g.labels
    assert g.attrs["Config"]["Image"] == os.environ.get("FLASH_TEST_IMAGE", "flash-vllm:enginetest")  # the server's
    assert wait_for(lambda: "armed on" in g.logs().decode(), 30), g.logs().decode()
    st = json.loads(flash("status", "--json").stdout)
    assert st["guard"]["state"] == "running" and st["guard"]["last_event"]["event"] == "armed"
    assert not st["guard"]["stopped_server"]
    # GUARD=0 takes it away on the next serve
    res = flash("serve", "published", "--start-check", "1", "GUARD=0", "--force")
    assert res.returncode == 0 and "removed the memory guard sidecar" in res.stderr, res.stderr
    assert not docker_client.containers.list(all=True, filters={"label": f"org.flash.guard={flash.name}"})
    res = flash("serve", "published", "--start-check", "1", "--force", f"GUARD_PORT={free_port()}")
    assert res.returncode == 0, res.stderr
    res = flash("rm")
    assert res.returncode == 0 and f"removed its memory guard {flash.name}-guard" in res.stdout, res.stdout
    assert not docker_client.containers.list(all=True, filters={"label": f"org.flash.guard={flash.name}"})
