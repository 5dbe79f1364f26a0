"""`flash service` with hostile values (issue 34): control characters refused in everything the unit
carries; every other value escaped so that systemd reads back exactly the word flash meant; and
`install` never says "wrote" for a unit systemd rejects.

systemd's own parser is the judge: `systemd-analyze verify` decodes an ExecStart= line's executable
path with the same word extraction (quotes, C escapes, specifiers) it applies to every argument,
and names the decoded path in its answer ("Command X is not executable", or "Executable name
contains special characters: X"): so each hostile string is put into that path and the path
systemd reports is compared with the one meant. Arguments also go through `$` substitution,
which verify does not show; `exec_words` below models systemd.syntax(7) for that part, and is
itself checked against systemd on every path case."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from flash_cli import profiles, service
from flash_cli.__main__ import main
from flash_cli.errors import ConfigError
from flash_cli.settings import resolve

FLASH = str(service.REPO / "flash")

# each one meant something else to systemd under shlex's single quotes, or is a specifier/variable
HOSTILE = [r"back\slash", r"new\nline", r"tab\tx", "two\\\\back", "trail\\", r"hex\x41", "100%", "%n%i%H", "%%",
           'dq"uote', "sq'uote", "sp ace", "a;b", ";", "ü✓", 'mix\\"ed\'%$', "$HOME", "${HOME}", "$$", "-dash", "@at"]


def analyze() -> str:
    exe = shutil.which("systemd-analyze")
    # never a skip: tests/run's unit-tier setup (tests/support/tier-unit.sh) installs Debian's systemd
    assert exe, "systemd-analyze is missing: run tests/support/tier-unit.sh (installs Debian's systemd package)"
    return exe


def verify_text(tmp_path: Path, name: str, text: str, user: bool = False) -> subprocess.CompletedProcess:
    units = tmp_path / "units"
    units.mkdir(exist_ok=True)
    (units / "docker.service").write_text("[Unit]\nDescription=stand-in\n[Service]\nExecStart=/bin/true\n")
    (units / name).write_text(text)
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:", "XDG_RUNTIME_DIR": str(rt), "SYSTEMD_LOG_COLOR": "0"}
    return subprocess.run([analyze(), *(["--user"] if user else []), "verify", str(units / name)],
                          capture_output=True, text=True, env=env, timeout=60)


DECODED = re.compile(r"Command (.*) is not executable: |Executable name contains special characters: (.*)$", re.M)


def systemd_decodes(tmp_path: Path, exec_line: str) -> str:
    res = verify_text(tmp_path, "probe.service", f"[Service]\nExecStart={exec_line}\n")
    m = DECODED.search(res.stdout + res.stderr)
    assert m, res.stdout + res.stderr
    return m.group(1) or m.group(2)


# --- a model of systemd's Exec word splitting (systemd.syntax(7), systemd.service(5)) ----------
C_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "s": " ", "\\": "\\",
             '"': '"', "'": "'"}


def exec_words(value: str, *, args: bool = True) -> list[str]:
    """Specifiers first (%% → %; flash writes no other), then words with quotes and C escapes, then
    `$$` → `$` in the arguments (a lone `$VAR` would be substituted: flash must never leave one)."""
    assert not re.search(r"%[^%]", value.replace("%%", "")), value
    value = value.replace("%%", "%")
    words, i, n = [], 0, len(value)
    while i < n:
        while i < n and value[i] in " \t":
            i += 1
        if i >= n:
            break
        word, quote = "", None
        while i < n and (quote or value[i] not in " \t"):
            c = value[i]
            if c == "\\":
                e = value[i + 1]
                if e == "x":
                    word += chr(int(value[i + 2:i + 4], 16))
                    i += 4
                    continue
                word += C_ESCAPES[e]
                i += 2
                continue
            if quote and c == quote:
                quote = None
            elif not quote and c in "\"'":
                quote = c
            else:
                word += c
            i += 1
        assert quote is None, value
        words.append(word)
    if args:
        rest = []
        for w in words[1:]:
            assert not re.search(r"(?<!\$)\$(?!\$)", w.replace("$$", "")), f"unescaped $ in {w!r}"
            rest.append(w.replace("$$", "$"))
        words = [words[0], *rest]
    return words


def directive(text: str, key: str) -> str:
    (value,) = [ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith(key + "=")]
    return value


def settings(**overrides):
    p = profiles.load("speed")
    return resolve(p.layer(), {}, overrides, profile_name=p.name)


def plan(words=("speed",), home="/home/spark", flash=FLASH, scope="system", **overrides):
    return service.plan_install(list(words), settings(**overrides), scope=scope, env={"HOME": home}, flash=flash,
                                uid=1000, user="spark")


# --- systemd reads back what was meant ----------------------------------------------------------
@pytest.mark.parametrize("h", HOSTILE, ids=repr)
def test_systemd_decodes_each_hostile_path_exactly(tmp_path, h):
    path = f"/nonexistent/{h}/flash"
    line = service._cmd([path, "run"])
    assert systemd_decodes(tmp_path, line) == path
    assert exec_words(line, args=False)[0] == path  # the model agrees with systemd


@pytest.mark.parametrize("h", [r"back\slash", r"new\nline", "two\\\\back", r"hex\x41"], ids=repr)
def test_shlex_quoting_was_misread_by_systemd(tmp_path, h):
    """Why: the old unit quoted with shlex (single quotes), inside which systemd still undoes C
    escapes: `\\s` became a space, `\\n` a newline, `\\\\` one backslash."""
    path = f"/nonexistent/{h}/flash"
    assert systemd_decodes(tmp_path, shlex.quote(path)) != path


@pytest.mark.parametrize("h", HOSTILE, ids=repr)
def test_hostile_recipe_values_survive_and_the_unit_verifies(tmp_path, h):
    extra = f"--served-model-name {shlex.quote(h)}"
    p = plan(("speed", f"EXTRA={extra}"), home=f"/home/{h}")
    run = exec_words(directive(p.text, "ExecStart"))
    assert run[:4] == [FLASH, "service", "run", "speed"] and f"EXTRA={extra}" in run
    assert exec_words(directive(p.text, "ExecStop"))[1:] == ["stop", *run[3:]]
    envs = [exec_words("x " + ln.split("=", 1)[1], args=False)[1] for ln in p.text.splitlines()
            if ln.startswith("Environment=")]
    assert f"HOME=/home/{h}" in envs
    res = verify_text(tmp_path, p.unit, p.text)
    assert res.returncode == 0 and res.stdout + res.stderr == "", res.stdout + res.stderr


def test_hostile_repository_path_stays_one_working_directory_and_a_url(tmp_path, monkeypatch):
    repo = tmp_path / "re po 100%"
    (repo / "docs").mkdir(parents=True)
    (repo / "flash").write_text("#!/bin/sh\n")
    (repo / "flash").chmod(0o755)
    monkeypatch.setattr(service, "REPO", repo)
    p = plan(flash=str(repo / "flash"))
    assert directive(p.text, "WorkingDirectory").replace("%%", "%") == str(repo)
    assert " " not in directive(p.text, "Documentation")
    assert exec_words(directive(p.text, "ExecStart"))[0] == str(repo / "flash")
    res = verify_text(tmp_path, p.unit, p.text)
    assert res.returncode == 0 and res.stdout + res.stderr == "", res.stdout + res.stderr


# --- control characters: refused, never written --------------------------------------------------
def test_the_issue_repro_newline_in_extra_is_refused(capsys, tmp_path):
    # `flash service install default $'EXTRA=--x\nExecStart=\n…'`: wrote the newline raw; flash said "wrote"
    assert main(["service", "install", "--dry-run", "default", "EXTRA=--x\nExecStart=\n/bin/sh -c id"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "EXTRA=" in err and "control character '\\n'" in err and "wrote" not in err


@pytest.mark.parametrize("field", ["home", "flash", "user", "word"])
@pytest.mark.parametrize("ch", ["\n", "\r", "\x00", "\x1b", "\x7f", "\t"], ids=repr)
def test_control_characters_in_anything_the_unit_carries(field, ch):
    s = settings()
    kw = {"home": "/home/spark", "flash": FLASH, "user": "spark"}
    words = ["speed"]
    if field == "word":
        words = ["speed", f"NAME=x{ch}ExecStart=/bin/sh"]
    else:
        kw[field] = f"{kw[field]}{ch}ExecStart=/bin/sh"
    with pytest.raises(ConfigError) as err:
        service.render_unit(words, s, scope="system", **kw)
    assert "control character" in str(err.value) and err.value.exit_code == 2


# --- install through the CLI: verified before it is written -----------------------------------
@pytest.fixture
def fake_systemctl(tmp_path, monkeypatch):
    """systemd does not run as PID 1 here: a systemctl that records its argv stands in (systemctl
    only; systemd-analyze is the real one)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "systemctl.log"
    (bin_dir / "systemctl").write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    (bin_dir / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent.sock")
    return log


def test_install_writes_a_hostile_recipe_systemd_accepts(fake_systemctl, tmp_path, capsys):
    assert main(["service", "install", "--user", "speed", r"EXTRA=--served-model-name 'a\sb 100% $HOME'"]) == 0
    unit = tmp_path / "cfg" / "systemd" / "user" / "flash-qwen38-flash.service"
    run = exec_words(directive(unit.read_text(), "ExecStart"))
    assert r"EXTRA=--served-model-name 'a\sb 100% $HOME'" in run
    assert "systemd-analyze verify: accepted" in capsys.readouterr().err


def test_install_refuses_a_unit_systemd_rejects_and_never_says_wrote(fake_systemctl, tmp_path, capsys, monkeypatch):
    from flash_cli.commands import service as cmd

    monkeypatch.setattr(cmd, "FLASH", "/nonexistent/flash")  # systemd: "Command … is not executable"
    assert main(["service", "install", "--user", "speed"]) == 1
    err = capsys.readouterr().err
    assert "systemd rejects the unit" in err and "/nonexistent/flash is not executable" in err
    assert "wrote" not in err
    assert not (tmp_path / "cfg" / "systemd" / "user" / "flash-qwen38-flash.service").exists()
    assert not fake_systemctl.exists()  # no daemon-reload, no enable
