"""Patch 1's pure helpers and registry entry (no vLLM): layer index from a module prefix, the
table directory rule, and the declared bases/gate the matrix and the settings table rely on."""

from __future__ import annotations

import pytest

from flash_vllm.patches import ple_mmap
from flash_vllm.registry import by_number


@pytest.mark.parametrize("prefix, layer", [
    ("model.language_model.layers.1.ple.ple_embedding.ngram_embedding", 1),
    ("model.layers.17.ple.ple_embedding.ngram_embedding", 17),
    ("layers.0.ple", 0),
    ("model.mtp.ple.ngram_embedding", None),
    ("model.sublayers.3.ple", None),  # "sublayers" is not "layers"
])
def test_layer_of(prefix, layer):
    assert ple_mmap.layer_of(prefix) == layer


def test_table_dir_prefers_env_dir_and_needs_a_local_directory(tmp_path):
    env_dir, model_dir = tmp_path / "env", tmp_path / "model"
    env_dir.mkdir()
    model_dir.mkdir()
    assert ple_mmap.table_dir(str(env_dir), str(model_dir)) == str(env_dir)
    assert ple_mmap.table_dir(None, str(model_dir)) == str(model_dir)
    with pytest.raises(ValueError, match="VLLM_PLE_MMAP_DIR"):
        ple_mmap.table_dir(None, None)
    with pytest.raises(ValueError, match="Qwen/Qwen3.8-Flash-Next"):  # a hub id, not a directory
        ple_mmap.table_dir(None, "Qwen/Qwen3.8-Flash-Next")


def test_registry_entry():
    p = by_number(1)
    assert p.name == "ple-mmap" and p.gate.env == "VLLM_PLE_MMAP"
    assert p.enabled({"VLLM_PLE_MMAP": "1"}) and not p.enabled({})
    assert not p.enabled({"VLLM_PLE_MMAP": "1", "FLASH_DISABLE_PATCHES": "1"})
    assert p.expected_status("v0.33") == "applies" and p.expected_status("v0.29") == "not-ported"
    assert "PIECEWISE" in p.why  # the graph regime shipped is stated where PATCHES.md shows it


def test_run_spec_turns_the_gate_on_with_piecewise_graphs():
    """The patch is only legal under PIECEWISE graphs: the run spec must ship both together."""
    import json

    from flash_cli import settings, spec

    s = settings.resolve({}, {}, {})
    assert spec.container_env(s, needs_key=False)["VLLM_PLE_MMAP"] == "1"
    args = spec.compilation_args(s)
    assert json.loads(args[args.index("--compilation-config") + 1])["cudagraph_mode"] == "PIECEWISE"
