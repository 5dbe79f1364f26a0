"""./flash's first run: it builds the venv with progress on stderr (issue 37: a silent 110 s
looked like a hang), and a failed install says so with pip's last lines. The real launcher runs
under sh; python3 on PATH is a stand-in that plays venv, pip and flash_cli (a real install takes
two minutes and the network)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = r"""#!/bin/sh
case "$1 $2" in
  "-c "*) exit 0 ;;
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0 ;;
  "-m pip")
    for p in docker requests huggingface-hub; do echo "Collecting $p==1.0"; sleep 0.6; done
    [ -n "${FAKE_PIP_FAIL:-}" ] && { echo "ERROR: no matching distribution for numpy"; exit 1; }
    echo "Successfully installed docker requests huggingface-hub"; exit 0 ;;
  "-m flash_cli") shift 2; echo "flash_cli ran: $*"; exit 0 ;;
esac
exit 9
"""


def launch(tmp_path, **env):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    full = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FLASH_VENV": str(venv),
            "FLASH_INSTALL_TICK": "1", **env}
    return venv, subprocess.run(["sh", str(ROOT / "flash"), "status"], env=full, capture_output=True, text=True,
                                timeout=60)


def test_first_run_shows_an_estimate_and_progress_then_runs(tmp_path):
    venv, res = launch(tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "flash_cli ran: status\n"
    err = res.stderr
    assert "about 2 minutes and ~450 MB" in err  # the estimate, before the wait
    ticks = [ln for ln in err.splitlines() if ln.startswith("flash:   ") and "packages fetched" in ln]
    assert ticks and "(now: " in ticks[-1]  # progress while pip works
    assert "environment ready after" in err
    assert (venv / ".flash-installed").read_text().strip() == str(ROOT)
    _, again = launch(tmp_path)  # installed: no second install, nothing on stderr
    assert again.returncode == 0 and again.stderr == ""


def test_a_failed_install_names_the_log_and_shows_pips_last_lines(tmp_path):
    venv, res = launch(tmp_path, FAKE_PIP_FAIL="1")
    assert res.returncode == 1 and res.stdout == ""
    assert "ERROR: no matching distribution for numpy" in res.stderr
    assert f"installing the environment failed (whole log: {venv / '.install.log'})" in res.stderr
    assert not (venv / ".flash-installed").exists()  # the next run retries
