"""flash_cli.hfcache: snapshot choice, completeness, quant method, variant state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flash_cli import hfcache

REV_A = "a" * 40
REV_B = "b" * 40


def make_snapshot(cache: Path, model: str, rev: str, shards=("model-1.safetensors",), quant="file") -> Path:
    """A cache entry in the real layout: snapshot files are relative links into blobs/."""
    repo = hfcache.repo_dir(cache, model)
    snap = repo / "snapshots" / rev
    blobs = repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir(exist_ok=True)
    files = {name: "{}" for name in hfcache.ESSENTIAL}
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {f"t{i}": s for i, s in enumerate(shards)}})
    cfg = {"model_type": "qwen4_exp"}
    if quant == "config":
        cfg["quantization_config"] = {"quant_method": "modelopt"}
    elif quant == "text_config":
        cfg["text_config"] = {"quantization_config": {"config_groups": {}}}
    files["config.json"] = json.dumps(cfg)
    if quant == "file":
        files["hf_quant_config.json"] = json.dumps({"quantization": {"quant_algo": "NVFP4"}})
    for s in shards:
        files[s] = "x"
    for i, (name, text) in enumerate(sorted(files.items())):
        blob = blobs / f"{rev[:8]}{i:032d}"
        blob.write_text(text)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    return snap


def test_repo_dir_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hfcache.repo_dir("~/hf", "org/name") == tmp_path / "hf" / "hub" / "models--org--name"


def test_resolve_prefers_revision_then_refs_then_newest_non_variant(tmp_path):
    model = "RadixArk/Qwen3.8-Flash-Next-NVFP4"
    assert hfcache.resolve_snapshot(tmp_path, model) is None
    a = make_snapshot(tmp_path, model, REV_A)
    b = make_snapshot(tmp_path, model, REV_B)
    os.utime(a, (1, 1))
    os.utime(b, (2, 2))
    variant = b.with_name(REV_B + "-fp8hybrid")
    variant.mkdir()
    os.utime(variant, (10, 10))  # newest, but a variant is never a snapshot
    assert hfcache.resolve_snapshot(tmp_path, model) == b
    assert hfcache.resolve_snapshot(tmp_path, model, REV_A) == a
    assert hfcache.resolve_snapshot(tmp_path, model, "c" * 40) is None
    refs = hfcache.repo_dir(tmp_path, model) / "refs"
    refs.mkdir()
    (refs / "master").write_text(REV_A + "\n")
    assert hfcache.resolve_snapshot(tmp_path, model) == a
    (refs / "main").write_text(REV_B)
    assert hfcache.resolve_snapshot(tmp_path, model) == b
    assert hfcache.resolve_snapshot(tmp_path, model, "master") == a  # a ref name works as revision
    (refs / "main").write_text("d" * 40)  # points at a snapshot we don't have: fall through
    assert hfcache.resolve_snapshot(tmp_path, model) == a


def test_missing_files_names_each_and_counts_dangling_links(tmp_path):
    snap = make_snapshot(tmp_path, "o/m", REV_A, shards=("s1.safetensors", "s2.safetensors"))
    assert hfcache.missing_files(snap) == []
    os.unlink(os.path.realpath(snap / "s2.safetensors"))  # link now dangles
    (snap / "chat_template.jinja").unlink()
    assert hfcache.missing_files(snap) == ["chat_template.jinja", "s2.safetensors"]


def test_missing_quant_config_and_unreadable_index(tmp_path):
    snap = make_snapshot(tmp_path, "o/m", REV_A, quant="none")
    miss = hfcache.missing_files(snap)
    assert len(miss) == 1 and miss[0].startswith("quantization config")
    (snap / "model.safetensors.index.json").unlink()
    (snap / "model.safetensors.index.json").write_text("{not json")
    assert "model.safetensors.index.json (unreadable)" in hfcache.missing_files(snap)


@pytest.mark.parametrize("quant,method", [("file", "modelopt"), ("config", "modelopt"),
                                          ("text_config", "compressed-tensors"), ("none", None)])
def test_quant_method(tmp_path, quant, method):
    snap = make_snapshot(tmp_path, "o/m", REV_A, quant=quant)
    assert hfcache.quant_method(snap) == method
    assert (not hfcache.missing_files(snap)) == (quant != "none")


def test_variant_dir_and_state(tmp_path):
    snap = make_snapshot(tmp_path, "o/m", REV_A)
    assert hfcache.variant_dir(snap, "nvfp4") == snap
    assert hfcache.variant_dir(snap, "hybrid").name == REV_A + "-fp8hybrid"
    assert hfcache.variant_dir(snap, "hybrid-mtp").name == REV_A + "-fp8hybrid-mtpnvfp4"
    with pytest.raises(ValueError, match="hybrid-mtp"):
        hfcache.variant_dir(snap, "fp8")
    assert hfcache.variant_state(snap, "nvfp4") == "ready"
    assert hfcache.variant_state(snap, "hybrid") == "absent"

    var = hfcache.variant_dir(snap, "hybrid")
    var.mkdir()
    for p in snap.iterdir():
        os.symlink(os.path.relpath(os.path.realpath(p), var), var / p.name)
    assert hfcache.variant_state(snap, "hybrid") == "absent"  # built but never marked
    marker = {"source_revision": REV_A, "format": hfcache.VARIANT_FORMAT["hybrid"]}
    (var / ".prepared").write_text(json.dumps(marker))
    assert hfcache.variant_state(snap, "hybrid") == "ready"
    (var / ".prepared").write_text(json.dumps({**marker, "source_revision": REV_B}))
    assert hfcache.variant_state(snap, "hybrid") == "stale"
    (var / ".prepared").write_text("")  # upstream's bare `touch .prepared`
    assert hfcache.variant_state(snap, "hybrid") == "stale"
    (var / ".prepared").write_text(json.dumps(marker))
    (var / "tokenizer.json").unlink()
    assert hfcache.variant_state(snap, "hybrid") == "stale"
    os.symlink(os.path.realpath(snap / "tokenizer.json"), var / "tokenizer.json")
    (snap / "new_file.txt").write_text("added upstream after prep")
    assert hfcache.variant_state(snap, "hybrid") == "stale"
    (snap / "new_file.txt").unlink()
    assert hfcache.variant_state(snap, "hybrid") == "ready"
    os.unlink(os.path.realpath(snap / "model-1.safetensors"))
    assert hfcache.variant_state(snap, "nvfp4") == "stale"
    assert hfcache.variant_state(tmp_path / "nope", "nvfp4") == "absent"
