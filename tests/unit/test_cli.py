"""The CLI as users run it: real processes, exit codes, stdout/stderr split."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def flash(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "flash_cli", *args], capture_output=True, text=True, env=full, cwd=ROOT)


def test_profiles_lists_names_on_stdout():
    res = flash("profiles")
    assert res.returncode == 0
    names = [ln.split()[0] for ln in res.stdout.splitlines()[1:] if ln.strip() and not ln.startswith(("serve", "a profile"))]
    assert names[0] == "default" and "v0.29" in names and len(names) == len(set(names))


def test_profiles_json_and_show():
    import json

    res = flash("profiles", "--json")
    assert {p["name"] for p in json.loads(res.stdout)} >= {"default", "context-1m"}
    res = flash("profiles", "show", "speed", "--json")
    data = json.loads(res.stdout)
    assert data["settings"]["MTP"] == {"value": "3", "source": "profile:speed"}


def test_serve_dry_run_prints_docker_run_and_runs_nothing():
    res = flash("serve", "default", "MTP=3", "PORT=18301", "--dry-run", env={"DOCKER_HOST": "tcp://127.0.0.1:1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("docker run")
    assert "-p 127.0.0.1:18301:8000" in res.stdout and '"num_speculative_tokens":3' in res.stdout


def test_first_word_with_equals_means_default_profile():
    res = flash("serve", "MTP=0", "--dry-run")
    assert res.returncode == 0 and "--speculative-config" not in res.stdout
    assert "profile 'default'" in res.stderr


def test_unknown_key_exits_2_with_did_you_mean():
    res = flash("serve", "default", "MTPP=3", "--dry-run")
    assert res.returncode == 2
    assert "MTPP" in res.stderr and "did you mean MTP?" in res.stderr and res.stdout == ""


def test_bad_value_exits_2_naming_accepted_values():
    res = flash("serve", "KV_DTYPE=fp16", "--dry-run")
    assert res.returncode == 2 and "KV_DTYPE" in res.stderr and "fp8_e4m3" in res.stderr


def test_unknown_profile_and_non_assignment():
    res = flash("serve", "turbo", "--dry-run")
    assert res.returncode == 2 and "unknown profile 'turbo'" in res.stderr and "context-1m" in res.stderr
    res = flash("serve", "default", "MTP", "--dry-run")
    assert res.returncode == 2 and "KEY=VALUE" in res.stderr


def test_environment_beats_profile_and_args_beat_environment():
    res = flash("serve", "speed", "--dry-run", env={"MTP": "4", "CTX": "300000"})
    assert '"num_speculative_tokens":4' in res.stdout and "--max-model-len 300000" in res.stdout
    res = flash("serve", "speed", "MTP=1", "--dry-run", env={"MTP": "4"})
    assert '"num_speculative_tokens":1' in res.stdout


def test_serve_sh_by_hand_with_environment():
    env = {**os.environ, "DRY": "1", "MODE": "hybrid", "YARN": "1", "CTX": "500000"}
    env.pop("FLASH_VENV", None)  # the checkout's own .venv (tests/run made it), never another one
    res = subprocess.run([str(ROOT / "scripts" / "serve.sh")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "--max-model-len 500000" in res.stdout and "-fp8hybrid" in res.stdout and "--hf-overrides" in res.stdout
    env["DRY"] = "maybe"
    res = subprocess.run([str(ROOT / "scripts" / "serve.sh")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 2 and "DRY" in res.stderr


def test_debug_traceback_only_with_flash_debug():
    res = flash("serve", "MODE=x", "--dry-run")
    assert "Traceback" not in res.stderr
    res = flash("serve", "MODE=x", "--dry-run", env={"FLASH_DEBUG": "1"})
    assert "Traceback" in res.stderr
