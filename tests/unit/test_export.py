"""`flash export compose` (pure): the document carries serve's RunSpec, the key only as a secret
file, `$` escaped for Compose's interpolation; the engine tier starts it (test_export_compose.py)."""

from __future__ import annotations

import json

import yaml

from flash_cli import export
from flash_cli.settings import resolve
from flash_cli.spec import build


def spec_for(**over):
    s = resolve(overrides={k: str(v) for k, v in over.items()})
    return s, build(s, profile="default", snapshot="abc123", hf_cache="/data/hf", state_dir="/st")


def test_compose_is_serves_runspec_with_the_key_as_a_secret_file():
    s, spec = spec_for(BIND="0.0.0.0", EXTRA="--x=$HOME")
    doc = export.compose(spec, s, "/data/hf")
    srv = doc["services"]["server"]
    assert srv["image"] == spec.image and srv["container_name"] == spec.name
    assert srv["entrypoint"] == spec.entrypoint
    assert srv["command"][:3] == ["vllm", "serve", "/hf/hub/models--nvidia--Qwen3.8-Flash-Next-NVFP4/snapshots/abc123"]
    assert "--x=$$HOME" in srv["command"]  # Compose would interpolate a bare $HOME
    assert srv["ports"] == [f"0.0.0.0:{s['PORT']}:8000"] and srv["ipc"] == "host" and srv["shm_size"] == s["SHM_SIZE"]
    assert srv["secrets"] == ["flash_api_key"] and srv["environment"]["FLASH_API_KEY_FILE"] == "/run/secrets/flash_api_key"
    assert doc["secrets"] == {"flash_api_key": {"file": "${FLASH_API_KEY_FILE:-./flash-api-key}"}}
    assert not any(v["target"] == "/run/flash/api_key" for v in srv["volumes"])  # the state-dir bind is gone
    hf = next(v for v in srv["volumes"] if v["target"] == "/hf")
    assert hf == {"type": "bind", "source": "${HF_CACHE:-/data/hf}", "target": "/hf", "read_only": True}
    assert doc["volumes"]["flash-compile-vllm"] == {"name": "flash-compile-vllm"}
    assert srv["deploy"]["resources"]["reservations"]["devices"] == [{"driver": "nvidia", "capabilities": ["gpu"], "count": "all"}]
    assert srv["healthcheck"]["start_period"] == "1800s" and srv["labels"]["org.flash.name"] == spec.name
    guard = doc["services"]["guard"]
    assert guard["labels"]["org.flash.guard"] == spec.name and "org.flash.name" not in guard["labels"]
    assert guard["healthcheck"] == {"disable": True} and "deploy" not in guard


def test_compose_text_round_trips_and_loopback_needs_no_key():
    s, spec = spec_for(GUARD=0)
    doc = export.compose(spec, s, "/data/hf", guard=False)
    text = export.compose_text(doc, export.header_lines(spec, "default", s))
    assert text.startswith("# flash profile 'default'")
    assert yaml.safe_load(text) == doc
    assert "secrets" not in doc and "secrets" not in doc["services"]["server"]
    assert list(doc["services"]) == ["server"]
    assert "VLLM_API_KEY" not in json.dumps(doc)


def test_export_cli_writes_the_file(tmp_path, capsys):
    from flash_cli.__main__ import main

    out = tmp_path / "docker-compose.yml"
    assert main(["export", "compose", "published", "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["services"]["server"]["labels"]["org.flash.profile"] == "published"
    assert "<SNAPSHOT>" in doc["services"]["server"]["command"][2]  # no weights here: said on stderr
    assert "is not in" in capsys.readouterr().err


def test_sparkrun_recipe_moves_the_model_under_sparkruns_mount_and_templates_its_flags():
    import shlex

    from flash_cli import profiles, sparkrun

    s, spec = spec_for(MODE="hybrid", BIND="0.0.0.0")
    doc = sparkrun.recipe(spec, s, profiles.load("default"))
    assert doc["model_revision"] == "abc123" and doc["runtime"] == "vllm" and doc["mode"] == "solo"
    assert doc["env"]["HF_HOME"] == "/cache/huggingface" and "FLASH_API_KEY_FILE" not in doc["env"]
    argv = shlex.split(doc["command"])
    assert argv[2] == "/cache/huggingface/hub/models--nvidia--Qwen3.8-Flash-Next-NVFP4/snapshots/abc123-fp8hybrid"
    for flag, key in sparkrun.PLACEHOLDERS.items():
        assert argv[argv.index(flag) + 1] == "{" + key + "}"
    assert doc["defaults"]["gpu_memory_utilization"] == "0.80" and doc["defaults"]["port"] == 8000
    assert yaml.safe_load(sparkrun.recipe_text(spec, s, profiles.load("default"))) == doc
