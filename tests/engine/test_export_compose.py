"""Engine tier: `flash export compose` → a docker-compose.yml that Compose validates and starts
with no repository around it (issue 36).

Debian 12 packages Compose v1 only (docker-compose 1.29.2); the v2 plugin is not packaged there and
cannot be downloaded here. The exported file uses only keys both accept, and this test runs it with
v1: `docker-compose config` validates it, `docker-compose up -d` starts it from a directory holding
nothing but the file and the key, against the real engine, and the stand-in answers through it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

import pytest
import yaml

pytestmark = pytest.mark.docker


def compose_bin() -> str:
    exe = shutil.which("docker-compose")
    if not exe:  # tests/support/apt.sh-style install belongs to the tier; absence is a broken setup
        pytest.fail("docker-compose not found: apt-get install docker-compose (Debian 12: Compose v1.29.2)")
    return exe


def test_exported_compose_validates_and_serves_without_the_repo(flash, docker_client, tmp_path):
    dc = compose_bin()
    out = tmp_path / "deploy"
    out.mkdir()
    res = flash("export", "compose", "published", "API_KEY=on", "GUARD_PORT=0", "-o", str(out / "docker-compose.yml"))
    assert res.returncode == 0, res.stderr
    doc = yaml.safe_load((out / "docker-compose.yml").read_text())
    server = doc["services"]["server"]
    # the key is a secret file: neither in the file nor in the environment
    assert server["environment"]["FLASH_API_KEY_FILE"] == "/run/secrets/flash_api_key"
    assert "VLLM_API_KEY" not in json.dumps(doc) and doc["secrets"]["flash_api_key"]["file"].startswith("${FLASH_API_KEY_FILE:-")
    assert server["healthcheck"]["test"][:4] == ["CMD", "python3", "-m", "flash_vllm.launch"]
    assert doc["services"]["guard"]["depends_on"] == ["server"]
    key = "k-" + "7" * 30
    (out / "flash-api-key").write_text(key + "\n")
    (out / "flash-api-key").chmod(0o600)
    project = flash.name.replace("-", "")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # nothing of flash's: the file stands alone
    cfg = subprocess.run([dc, "-p", project, "config"], cwd=out, env=env, capture_output=True, text=True, timeout=60)
    assert cfg.returncode == 0, cfg.stderr
    assert str(flash.hf) in cfg.stdout  # ${HF_CACHE:-…} resolved to the exporting machine's cache
    try:
        up = subprocess.run([dc, "-p", project, "up", "-d"], cwd=out, env=env, capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        url = f"http://127.0.0.1:{flash.port}"

        def get(path: str, auth: bool):
            req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if auth else {})
            try:
                with urllib.request.urlopen(req, timeout=3) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code
            except OSError:
                return None

        end = time.monotonic() + 120
        while time.monotonic() < end and get("/health", False) != 200:
            time.sleep(1)
        assert get("/health", False) == 200
        assert get("/v1/models", False) == 401 and get("/v1/models", True) == 200  # the secret file's key
        c = docker_client.containers.get(flash.name)
        assert key not in json.dumps(c.attrs)  # not in docker inspect
        # flash finds the compose-started server by its labels, with its guard beside it
        st = json.loads(flash("status", "--json").stdout)
        assert st["state"] == "running" and st["api"] == "up" and st["guard"]["state"] == "running"
    finally:
        subprocess.run([dc, "-p", project, "down", "-t", "5"], cwd=out, env=env, capture_output=True, timeout=300)


def test_gpu_and_bridge_variants_validate(flash, tmp_path):
    dc = compose_bin()
    for words in (["default", "GPUS=all", "NETWORK=bridge", "BIND=0.0.0.0"], ["context", "EXTRA=--x-y=$HOME"]):
        f = tmp_path / f"{words[0]}.yml"
        res = flash("export", "compose", *words, "-o", str(f))
        assert res.returncode == 0, res.stderr
        cfg = subprocess.run([dc, "-f", str(f), "config"], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                             text=True, timeout=60)
        assert cfg.returncode == 0, cfg.stderr
        doc = yaml.safe_load(cfg.stdout)
        server = doc["services"]["server"]
        if words[0] == "default":
            assert server["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
            assert f"0.0.0.0:{flash.port}:8000" in json.dumps(server["ports"]) and "flash_api_key" in doc["secrets"]
        else:  # a literal $ survives interpolation: config prints it re-escaped ($$); an unescaped
            # $HOME would have been interpolated (here: HOME unset, "" with a warning)
            assert "--x-y=$$HOME" in server["command"] and "HOME variable is not set" not in cfg.stderr
