"""Front-end pieces that need no Docker: state files, preflight checks, recipe words."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from flash_cli import preflight, recipe, state
from flash_cli.errors import ConfigError, PortInUse, UsageError, WeightsMissing
from flash_cli.settings import resolve
from flash_common import releases


def test_api_key_generated_once_0600(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    path, created = state.ensure_api_key("box")
    assert created and path == tmp_path / "flash" / "api-key.box"
    assert path.stat().st_mode & 0o777 == 0o600 and (tmp_path / "flash").stat().st_mode & 0o777 == 0o700
    key = state.read_api_key("box")
    assert key.startswith("sk-flash-") and len(key) > 40
    os.chmod(path, 0o644)
    again, created = state.ensure_api_key("box")
    assert not created and state.read_api_key("box") == key and again.stat().st_mode & 0o777 == 0o600


def test_logging_config_only_debugs_the_request_logger(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    cfg = json.loads(state.ensure_logging_config().read_text())
    assert cfg["loggers"]["vllm.entrypoints.logger"]["level"] == "DEBUG"
    assert cfg["loggers"]["vllm"]["level"] == "INFO"


def test_recipe_words():
    assert recipe.split_words(["speed", "MTP=1"]) == ("speed", ["MTP=1"], True)
    assert recipe.split_words(["MTP=1"]) == ("default", ["MTP=1"], False)
    assert recipe.split_words([]) == ("default", [], False)
    r = recipe.load(["context", "PORT=18400"], env={})
    assert r.settings["MODEL"].startswith("RadixArk/") and r.settings["PORT"] == 18400
    with pytest.raises(UsageError):
        recipe.load(["nope"], env={})


def test_port_check_sees_a_listener():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        s = resolve(overrides={"PORT": str(port)})
        problems = preflight.port(s, held_by_us=False)
        assert problems and problems[0].error is PortInUse and f"PORT={port + 1}" in problems[0].hint
        assert preflight.port(s, held_by_us=True) == []
    assert preflight.port(s, held_by_us=False) == []


def make_snapshot(cache: Path, model: str, files: dict[str, str]) -> Path:
    repo = cache / "hub" / f"models--{model.replace('/', '--')}"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for name, text in files.items():
        (snap / name).write_text(text)
    return snap


COMPLETE = {
    "config.json": json.dumps({"quantization_config": {"quant_method": "modelopt"}}),
    "generation_config.json": "{}", "tokenizer.json": "{}", "tokenizer_config.json": "{}",
    "chat_template.jinja": "x", "preprocessor_config.json": "{}",
    "model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-1.safetensors"}}),
    "model-1.safetensors": "",
}


def test_weight_problems_name_what_is_missing(tmp_path):
    s = resolve(overrides={"MODE": "nvfp4"})
    assert preflight.weights(s, tmp_path, None)[0].error is WeightsMissing
    files = dict(COMPLETE)
    del files["model-1.safetensors"]
    snap = make_snapshot(tmp_path, s["MODEL"], files)
    p = preflight.weights(s, tmp_path, snap)
    assert p and "model-1.safetensors" in p[0].message and "flash download" in p[0].hint


def test_hybrid_needs_prepared_layout_and_radixark_for_graft(tmp_path):
    snap = make_snapshot(tmp_path, "nvidia/Qwen3.8-Flash-Next-NVFP4", COMPLETE)
    assert preflight.weights(resolve(overrides={"MODE": "nvfp4"}), tmp_path, snap) == []
    p = preflight.weights(resolve(overrides={"MODE": "hybrid"}), tmp_path, snap)
    assert p and p[0].error is WeightsMissing and "fp8hybrid" in p[0].message and "prepare hybrid" in p[0].hint
    p = preflight.weights(resolve(overrides={"MODE": "hybrid-mtp"}), tmp_path, snap)
    assert p[0].error is ConfigError and "RadixArk" in p[0].message


def test_patch1_off_on_a_base_whose_stock_cannot_load_the_fp8_ple_table(tmp_path):
    """vLLM 0.29 builds the PLE table in bf16 without weight_scale for ModelOpt checkpoints (H200
    run40: every patch-1-off server died at load): refused before the boot, not after it."""
    snap = make_snapshot(tmp_path, "nvidia/Qwen3.8-Flash-Next-NVFP4", COMPLETE)
    for off in ("VLLM_PLE_MMAP=0", "FLASH_DISABLE_PATCHES=3,1"):
        p = preflight.weights(resolve(overrides={"MODE": "nvfp4", "BASE": "v0.29", "CONTAINER_ENV": off}), tmp_path, snap)
        assert [x.error for x in p] == [ConfigError], off
        assert "BASE=v0.29 cannot load" in p[0].message and "v0.30" in p[0].hint
    # patch 1 on, or a base whose stock loader reads the table: nothing to say
    assert preflight.weights(resolve(overrides={"MODE": "nvfp4", "BASE": "v0.29"}), tmp_path, snap) == []
    on30 = resolve(overrides={"MODE": "nvfp4", "BASE": "v0.30", "CONTAINER_ENV": "VLLM_PLE_MMAP=0"})
    assert preflight.weights(on30, tmp_path, snap) == []


def test_compressed_tensors_points_to_published(tmp_path):
    files = dict(COMPLETE, **{"config.json": json.dumps({"quantization_config": {"config_groups": {}}})})
    snap = make_snapshot(tmp_path, "nvidia/Qwen3.8-Flash-Next-NVFP4", files)
    p = preflight.weights(resolve(overrides={"MODE": "hybrid"}), tmp_path, snap)
    assert p[0].error is ConfigError and "flash serve published" in p[0].hint


def test_image_base_label_must_match():
    s = resolve(overrides={"BASE": "v0.29"})
    assert preflight.image(s, "img", None)[0].message.endswith("is not built")
    assert "built for base v0.33" in preflight.image(s, "img", {"org.flash.base": "v0.33"})[0].message
    assert preflight.image(s, "img", {"qwen38.base": "v0.29"}) == []


def runspec(s):
    """The RunSpec serve would run for these settings: what preflight checks."""
    from flash_cli.spec import build

    return build(s, profile="t", snapshot="SNAP", hf_cache="/hf", state_dir="/state")


def test_fp8_kv_served_on_every_base():  # patch 7 ported to 0.29/0.30, native from 0.31
    from flash_cli.settings import BASES

    for base in BASES:
        assert preflight.recipe(runspec(resolve(overrides={"KV_DTYPE": "fp8_e4m3", "BASE": base}))) == [], base


def test_every_base_served_now_patch1_is_ported():
    from flash_cli.settings import BASES

    for base in BASES:
        assert preflight.ple_mmap_gap(base) is None, base
        assert preflight.recipe(runspec(resolve(overrides={"BASE": base}))) == [], base


def test_base_refused_where_the_catalogue_says_patch1_is_not_ported(monkeypatch):
    from fakes.releases import with_cap

    with_cap(monkeypatch, "v0.29", ple_storage=None)
    p = preflight.recipe(runspec(resolve(overrides={"BASE": "v0.29"})))
    assert len(p) == 1 and p[0].error is ConfigError
    assert "patch 1" in p[0].message and "ple_storage=None" in p[0].message
    assert f"BASE={releases.CURRENT}" in p[0].hint
    assert preflight.recipe(runspec(resolve(overrides={"BASE": "v0.30"}))) == []


def test_setup_builds_v030_to_v032_from_their_release_image():
    from flash_cli.commands.setup import build_args, dockerfile_for

    assert build_args(resolve(overrides={"BASE": "v0.31"}))["BASE_IMAGE"] == "vllm/vllm-openai:v0.31.0"
    assert "BASE_IMAGE" not in build_args(resolve(overrides={"BASE": releases.CURRENT}))  # the Dockerfile's default
    assert build_args(resolve(overrides={"BASE": "v0.31", "BASE_IMAGE": "mine:1"}))["BASE_IMAGE"] == "mine:1"
    assert dockerfile_for("v0.29") == "Dockerfile.v0.29" and dockerfile_for("v0.31") == "Dockerfile"
