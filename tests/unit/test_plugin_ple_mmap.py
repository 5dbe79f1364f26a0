"""Patch 1's pure helpers and registry entry (no vLLM): layer index from a module prefix, the
table directory rule, and the declared bases/gate the matrix and the settings table rely on."""

from __future__ import annotations

import pytest

from flash_vllm.patches import p01_ple_mmap as ple_mmap
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
    from flash_vllm import compat

    assert all(p.expected_status(b) == "applies" for b in compat.ORDER) and not p.not_ported
    # one flavour per base, declared in one place
    assert set(ple_mmap.FLAVOURS) == set(compat.ORDER) == set(p.applies_to)
    assert ple_mmap.FLAVOURS["v0.29"] == "splitting-op"
    assert {ple_mmap.FLAVOURS[b] for b in compat.ORDER if b != "v0.29"} == {"storage"}
    assert "PIECEWISE" in p.why  # the graph regime shipped is stated where PATCHES.md shows it
    assert "vllm.models.qwen4_exp.nvidia.ple_layer:PLEVocabParallelEmbedding" in p.targets


def test_gather_guard_refuses_a_stream_capture_and_calls_the_stager(monkeypatch):
    """The guard both flavours gather through (no vLLM here: no breakable capture either)."""
    import torch  # the test extra pins it

    from flash_vllm.patches.p01_ple_mmap import v029 as ple_mmap_v029

    calls = []

    class FakeStager:
        def lookup(self, ids, out=None, raw=False):
            calls.append((ids, raw))
            out.fill_(3)

    out = torch.zeros(2, 4)
    ple_mmap.gather_into(lambda device: FakeStager(), "ids", out, raw=True)
    assert calls == [("ids", True)] and bool((out == 3).all())
    from flash_vllm.patches.p01_ple_mmap import guard as _ple_guard

    monkeypatch.setattr(_ple_guard, "_is_capturing", lambda torch: True)
    with pytest.raises(RuntimeError, match="PIECEWISE") as e:
        ple_mmap.gather_into(lambda device: FakeStager(), "ids", out)
    assert ple_mmap_v029.SPLIT_OP in str(e.value) and len(calls) == 1
    assert ple_mmap_v029.SPLIT_OP == f"vllm::{ple_mmap_v029.OP_NAME}" != ple_mmap_v029.STOCK_SPLIT_OP


@pytest.mark.parametrize("base, mode", [("v0.29", "auto"), ("v0.30", "eager"), ("v0.33", "eager")])
def test_run_spec_turns_the_gate_on_with_piecewise_graphs(base, mode):
    """The eager gather is only legal under PIECEWISE graphs: the run spec must ship both together,
    and leave splitting_ops unset (0.29 then copies its list, which our lookup op was appended to).
    (auto is the eager gather on v0.29; on v0.30+ it is the hoisted one: test_graph_regime.)"""
    import json

    from flash_cli import settings, spec

    s = settings.resolve({}, {}, {"BASE": base, "PLE_MODE": mode})
    assert spec.container_env(s, needs_key=False)["VLLM_PLE_MMAP_MODE"] == "eager"
    assert spec.container_env(s, needs_key=False)["VLLM_PLE_MMAP"] == "1"
    args = spec.compilation_args(s)
    cc = json.loads(args[args.index("--compilation-config") + 1])
    assert cc["cudagraph_mode"] == "PIECEWISE" and "splitting_ops" not in cc
