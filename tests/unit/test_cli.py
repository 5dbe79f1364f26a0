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
    assert "did you mean" not in res.stderr  # nothing near 'turbo'
    res = flash("serve", "defualt", "--dry-run")
    assert res.returncode == 2 and "unknown profile 'defualt': did you mean 'default'?" in res.stderr
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


def test_unreachable_engine_is_one_clean_message_in_every_command(tmp_path):
    """No Docker Engine at DOCKER_HOST: each command that needs it says so in one line, naming
    where it looked and why (docker-py's ('Connection aborted.', FileNotFoundError(…)) is gone)."""
    host = f"unix://{tmp_path / 'no-docker.sock'}"
    line = f"Docker Engine unreachable at {host}: No such file or directory"
    env = {"DOCKER_HOST": host, "HF_CACHE": str(tmp_path / "hf")}
    for cmd, code in ((["stop"], 3), (["logs"], 3), (["wait", "--timeout", "1"], 3), (["monitor", "status"], 3),
                      (["status"], 3), (["doctor"], 1), (["setup", "--dry-run"], 0)):
        res = flash(*cmd, env=env)
        out = res.stdout + res.stderr
        assert res.returncode == code, (cmd, out)
        assert line in out, (cmd, out)
        assert "Connection aborted" not in out and "FileNotFoundError" not in out and "Traceback" not in out, cmd


def test_settings_the_layout_never_reads_are_named():
    res = flash("serve", "default", "NODE_ADDRS=10.0.0.1,10.0.0.2", "PD_PORT=18400", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "NODE_ADDRS=10.0.0.1,10.0.0.2 does nothing with PARALLEL=none: only tpN/ppN/tp2pp2/dpN/pd/pdN read it" in res.stderr
    assert "PD_PORT=18400 does nothing with PARALLEL=none: only pd/pdN read it" in res.stderr
    res = flash("serve", "default", "--dry-run")  # nothing set: nothing said
    assert "does nothing with PARALLEL" not in res.stderr


def test_stop_with_nothing_there_is_idempotent_like_status(tmp_path):
    """Checked here against a real Engine API socket answering "no containers": a tiny HTTP
    server on a Unix socket, the way dockerd answers GET /containers/json."""
    import http.server
    import json
    import socketserver
    import threading

    class Engine(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"ApiVersion": "1.41"} if "/version" in self.path else [] if "/containers/" in self.path
                              else "OK").encode() if "/_ping" not in self.path else b"OK"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain" if "/_ping" in self.path else "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Api-Version", "1.41")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    sock = tmp_path / "docker.sock"
    srv = Server(str(sock), Engine)
    srv.get_request = lambda: (srv.socket.accept()[0], ("local", 0))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        res = flash("stop", env={"DOCKER_HOST": f"unix://{sock}"})
        assert res.returncode == 0, res.stderr
        assert res.stdout == "no flash container named 'qwen38-flash'; nothing to stop\n"
    finally:
        srv.shutdown()
        srv.server_close()
