"""Two boxes where box 1 is reached over ssh:// (issue 34): a real OpenSSH server (Debian's
openssh-server, installed by tests/support/tier-engine.sh) on a free loopback port, with its own
host key and a key-only login, whose sessions talk to the second Docker Engine of
test_multinode_engines (SetEnv DOCKER_HOST). flash reaches it the way a user's NODES=user@host
does: docker-py's ssh transport, the ssh binary carrying `docker system dial-stdio`.

The repro this pins: `flash status NODES=boxa,localhost` said "Install paramiko package to enable
ssh:// support" (docker-py's ssh module imports paramiko even when the ssh binary carries the
connection, and the `cli` extra lacked it).

OpenSSH's client reads ~/.ssh from the passwd entry, not from $HOME, so the test's client config
(key, known_hosts with the server's key, BatchMode) reaches it through `ssh -F`, given by a
two-line `ssh` on PATH that execs the real one, as a user's ~/.ssh/config would be read."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import free_port
from test_multinode_engines import boxes_env, get_json, node, second_engine  # noqa: F401 - the fixture

pytestmark = pytest.mark.docker
SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    port: int
    box: str  # as NODES writes it: user@127.0.0.1:port
    path: str  # PATH with the -F wrapper first
    dir: Path

    def client_env(self, **extra: str) -> dict:
        return {"PATH": self.path, **extra}


def _wait_for_banner(port: int, proc: subprocess.Popen, log: Path) -> None:
    for _ in range(100):
        if proc.poll() is not None:
            pytest.fail(f"sshd exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                if s.recv(64).startswith(b"SSH-2.0-"):
                    return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"sshd did not answer on 127.0.0.1:{port}:\n{log.read_text()[-2000:]}")


def _client(d: Path, name: str, known_hosts: Path, key: Path) -> str:
    """A bin dir whose `ssh` is the real client with this config; returns the PATH to use."""
    cfg = d / f"{name}.config"
    cfg.write_text(f"Host *\n  IdentityFile {key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {known_hosts}\n"
                   "  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
                   "  ConnectTimeout 10\n")
    bin_dir = d / f"{name}-bin"
    bin_dir.mkdir()
    real = shutil.which("ssh")
    assert real, "ssh is missing: tests/run engine installs openssh-client (tests/support/tier-engine.sh)"
    (bin_dir / "ssh").write_text(f'#!/bin/sh\nexec {real} -F {cfg} "$@"\n')
    (bin_dir / "ssh").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


@pytest.fixture(scope="module")
def sshd(second_engine, tmp_path_factory):  # noqa: F811 - pytest injects the imported fixture
    url, _ = second_engine
    # never a skip: the tier's setup installs it
    assert os.access(SSHD, os.X_OK), "sshd is missing: tests/run engine installs openssh-server (tests/support/tier-engine.sh)"
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "id_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    # restrict: no forwarding, no pty: dial-stdio needs nothing but the command
    (d / "authorized_keys").write_text(f"restrict {(d / 'id_key.pub').read_text()}")
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
        f"PidFile {d / 'sshd.pid'}\nSetEnv DOCKER_HOST={url}\n")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    log = d / "sshd.log"
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"))
    try:
        _wait_for_banner(port, proc, log)
        host_pub = " ".join((d / "host_key.pub").read_text().split()[:2])
        (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub}\n")
        path = _client(d, "good", d / "known_hosts", d / "id_key")
        yield Sshd(port, f"{getpass.getuser()}@127.0.0.1:{port}", path, d)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_tp2_with_box_1_over_ssh(flash, docker_client, second_engine, sshd):  # noqa: F811
    url, client2 = second_engine
    env = boxes_env(sshd.box, **sshd.client_env())
    assert env["NODES"] == f"localhost,{sshd.box}"
    res = flash("serve", "tp2", "--start-check", "2", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    # the worker was created through ssh on the second engine, and only there
    worker = node(client2, flash.name, 1)
    assert worker.labels["org.flash.nodes"] == env["NODES"] and "--headless" in worker.attrs["Args"]
    assert not docker_client.containers.list(all=True, filters={"label": [f"org.flash.name={flash.name}",
                                                                          "org.flash.node=1"]})
    res = flash("wait", "--timeout", "120", "--interval", "0.5", env=sshd.client_env())  # boxes from the labels
    assert res.returncode == 0, res.stdout + res.stderr
    assert get_json(f"{flash.url}/standin/argv")["ranks"]["world"] == 2
    # the command: status with NODES naming an ssh box (was "Install paramiko package …")
    st = flash("status", "--json", env=env)
    assert st.returncode == 0 and "paramiko" not in st.stderr, st.stdout + st.stderr
    rows = json.loads(st.stdout)["nodes"]
    assert [(r["node"], r["role"], r["state"]) for r in rows] == [(0, "head", "running"), (1, "worker", "running")]
    logs = flash("logs", "--node", "1", "50", env=sshd.client_env())
    assert "Launching vLLM headless rank 1 (tp)" in logs.stdout, logs.stdout + logs.stderr
    doc = flash("doctor", "tp2", "--json", env=env)
    checks = [(c["status"], c["text"]) for c in json.loads(doc.stdout)["checks"]]
    assert any(s == "ok" and t.startswith("same image on every box") for s, t in checks), checks
    assert not any("plaintext" in t for _, t in checks), checks  # ssh is the safe way: no tcp:// warning
    assert flash("stop", "--no-drain", env=sshd.client_env()).returncode == 0
    res = flash("rm", env=sshd.client_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert not client2.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})
    # every ssh session the CLI opened ended with it (docker-py's ssh subprocesses do not linger)
    time.sleep(0.5)
    ps = subprocess.run(["pgrep", "-f", "--", f"-F {sshd.dir}/good.config"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", ps.stdout


def test_unknown_host_key_refuses_the_box_and_changes_nothing(flash, docker_client, second_engine, sshd):  # noqa: F811
    url, client2 = second_engine
    empty = sshd.dir / "no_known_hosts"
    empty.write_text("")
    path = _client(sshd.dir, f"stranger-{flash.name}", empty, sshd.dir / "id_key")
    env = boxes_env(sshd.box, PATH=path)
    res = flash("serve", "tp2", env=env, timeout=120)
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"box 1 ({sshd.box}) is unreachable" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not docker_client.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})
    assert not client2.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})
