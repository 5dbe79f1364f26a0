"""`flash service`: the unit it writes (checked by systemd's own `systemd-analyze verify`), the
recipe it carries, the backoff, and install/uninstall against a recording systemctl."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from flash_cli import profiles, service
from flash_cli.__main__ import main
from flash_cli.settings import resolve

FLASH = str(service.REPO / "flash")


def settings(profile="speed", env=None, **overrides):
    p = profiles.load(profile)
    return resolve(p.layer(), env or {}, overrides, profile_name=p.name)


def plan(scope="system", words=("speed",), env=None, uid=1000, **overrides):
    s = settings(words[0] if words and "=" not in words[0] else "default", env=env, **overrides)
    return service.plan_install(list(words), s, scope=scope, env={"HOME": "/home/spark", **(env or {})},
                                flash=FLASH, uid=uid, user="spark")


def directive(text: str, key: str) -> list[str]:
    return [ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith(key + "=")]


def exec_argv(text: str, key: str) -> list[str]:
    """What systemd runs: its quoting rules for these lines are the shell's, with $$ and %% doubled."""
    (value,) = directive(text, key)
    return [w.replace("$$", "$").replace("%%", "%") for w in shlex.split(value)]


def test_unit_runs_the_recipe_drains_on_stop_and_restarts_on_failure():
    p = plan()
    t = p.text
    assert p.path == Path("/etc/systemd/system/flash-qwen38-flash.service") and p.unit == "flash-qwen38-flash.service"
    run = exec_argv(t, "ExecStart")
    assert run[:4] == [FLASH, "service", "run", "speed"] and run[-1].startswith("HF_CACHE=/")
    assert exec_argv(t, "ExecStop") == [FLASH, "stop", *run[3:]]
    assert directive(t, "Restart") == ["on-failure"] and directive(t, "RestartSec") == ["10"]
    assert directive(t, "TimeoutStopSec") == [str(60 + service.STOP_MARGIN_S)]  # DRAIN_TIMEOUT 60 + margin
    assert directive(t, "Requires") == ["docker.service"] and directive(t, "WantedBy") == ["multi-user.target"]
    assert directive(t, "User") == ["spark"]  # a system unit runs as the installing user (docker group)
    assert p.commands == [["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", p.unit]]


def test_user_unit_paths_and_linger_note():
    p = plan("user", env={"XDG_CONFIG_HOME": "/cfg"})
    assert p.path == Path("/cfg/systemd/user/flash-qwen38-flash.service")
    assert not directive(p.text, "User") and not directive(p.text, "Requires")
    assert directive(p.text, "WantedBy") == ["default.target"]
    assert p.commands[0] == ["systemctl", "--user", "daemon-reload"]
    assert any("enable-linger spark" in n for n in p.notes)


def test_root_installs_without_user_line():
    assert not directive(plan(uid=0).text, "User")


def test_environment_layer_is_written_into_the_unit():
    # a service does not inherit the installer's shell: env-layer settings become K=V words
    p = plan(words=("speed", "MTP=2"), env={"PORT": "18400", "HF_CACHE": "~/hf", "PATH": "/bin"})
    run = exec_argv(p.text, "ExecStart")
    assert run[3:] == ["speed", "MTP=2", "PORT=18400", f"HF_CACHE={os.path.expanduser('~/hf')}"]


def test_odd_characters_survive_systemd_quoting():
    p = plan(words=("speed", "EXTRA=--foo '$HOME 100%'"))
    assert exec_argv(p.text, "ExecStart")[4] == "EXTRA=--foo '$HOME 100%'"


def test_backoff_doubles_to_a_cap():
    assert [service.backoff_delay(n) for n in range(0, 9)] == [0, 10, 20, 40, 80, 160, 320, 600, 600]


# --- systemd's own verifier ---------------------------------------------------------------------
def analyze() -> str:
    exe = shutil.which("systemd-analyze")
    # never a skip: tests/run's unit-tier setup (tests/support/tier-unit.sh) installs Debian's systemd
    assert exe, "systemd-analyze is missing: run tests/support/tier-unit.sh (installs Debian's systemd package)"
    return exe


def verify(tmp_path: Path, p: service.ServicePlan) -> subprocess.CompletedProcess:
    units = tmp_path / "units"
    units.mkdir(exist_ok=True)
    # systemd resolves Requires=docker.service; Debian's docker.io ships that unit, this host runs
    # dockerd without systemd, so a minimal unit of that name stands in for the dependency only.
    (units / "docker.service").write_text("[Unit]\nDescription=stand-in\n[Service]\nExecStart=/bin/true\n")
    path = units / p.unit
    path.write_text(p.text)
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:", "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_COLOR": "0"}
    cmd = [analyze(), *(["--user"] if p.scope == "user" else []), "verify", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("scope", service.SCOPES)
def test_systemd_analyze_verify_accepts_the_unit(tmp_path, scope):
    res = verify(tmp_path, plan(scope, words=("speed", "EXTRA=--foo '$HOME 100%'")))
    # verify exits 0 even for keys it ignores: a clean unit prints nothing at all
    assert res.returncode == 0 and res.stdout + res.stderr == "", res.stdout + res.stderr


@pytest.mark.parametrize("old,new,needle", [
    ("Restart=on-failure", "Restart=sometimes", "restart specifier"),
    (f"ExecStart={FLASH}", "ExecStart=/nonexistent/flash", "/nonexistent/flash"),
    ("KillMode=mixed", "KillMode=gently", "kill mode"),
])
def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path, old, new, needle):
    p = plan()
    assert old in p.text
    p.text = p.text.replace(old, new)
    res = verify(tmp_path, p)
    assert needle in res.stdout + res.stderr


# --- install / status / uninstall through the CLI, against a recording systemctl --------------
@pytest.fixture
def fake_systemctl(tmp_path, monkeypatch):
    """systemd does not run as PID 1 here: a systemctl that records its argv stands in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "systemctl.log"
    (bin_dir / "systemctl").write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho inactive\n")
    (bin_dir / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent.sock")
    return log


def test_install_status_uninstall_user_unit(fake_systemctl, tmp_path, capsys):
    assert main(["service", "install", "--user", "speed", "MTP=2"]) == 0
    unit = tmp_path / "cfg" / "systemd" / "user" / "flash-qwen38-flash.service"
    assert unit.is_file() and "ExecStart=" in unit.read_text()
    assert exec_argv(unit.read_text(), "ExecStart")[3:5] == ["speed", "MTP=2"]
    assert fake_systemctl.read_text().splitlines() == ["--user daemon-reload", "--user enable --now flash-qwen38-flash.service"]
    capsys.readouterr()
    assert main(["service", "status", "--user", "speed"]) == 0
    out = capsys.readouterr().out
    assert "installed at" in out and "is-active: inactive" in out
    assert main(["service", "uninstall", "--user", "speed"]) == 0
    assert not unit.exists()
    assert fake_systemctl.read_text().splitlines()[-2:] == ["--user disable --now flash-qwen38-flash.service",
                                                           "--user daemon-reload"]


def test_install_refuses_a_recipe_that_cannot_boot(fake_systemctl, tmp_path, capsys):
    assert main(["service", "install", "--user", "v0.29", "MTP_BLOCK_DROP=0"]) == 2
    assert "disable_eagle_block_drop" in capsys.readouterr().err
    assert not (tmp_path / "cfg" / "systemd").exists() and not fake_systemctl.exists()


def test_dry_run_changes_nothing(fake_systemctl, tmp_path, capsys):
    assert main(["service", "install", "speed", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# /etc/systemd/system/flash-qwen38-flash.service" in out and "# then: systemctl enable --now" in out
    assert not fake_systemctl.exists()
