"""MTP graft on a tiny RadixArk hybrid + a tiny Inferact donor (pinned by revision and sha256)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from fakes import ckpt
from flash_cli import hfcache
from flash_cli.checkpoint import graft, hybrid, layout, verify
from flash_cli.errors import ConfigError, WeightsMissing
from flash_cli.settings import resolve
from flash_common.stheader import read_header

DONOR_REV = "d" * 40


def _donor(cache):
    snap = ckpt.write_snapshot(cache, "donor", ckpt.TINY, revision=DONOR_REV)
    path = snap / "nvfp4_experts_mtp.safetensors"
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return graft.Donor(revision=DONOR_REV, sha256=sha), path


@pytest.fixture
def ready(tmp_path):
    cache = tmp_path / "hf"
    snap = ckpt.write_snapshot(cache, "radixark")
    hybrid.prepare(snap)
    donor, _ = _donor(cache)
    settings = resolve(overrides={"MODEL": ckpt.RADIXARK, "HF_CACHE": str(cache), "MODE": "hybrid-mtp"})
    return snap, settings, donor


def test_graft_builds_the_documented_layout(ready):
    snap, settings, donor = ready
    out = graft.prepare(snap, settings, donor=donor)
    assert out["action"] == "built"
    dest = hfcache.variant_dir(snap, "hybrid-mtp")
    hyb = hfcache.variant_dir(snap, "hybrid")
    wm = json.loads((dest / layout.INDEX).read_text())["weight_map"]
    old = json.loads((hyb / layout.INDEX).read_text())["weight_map"]
    d = ckpt.TINY
    assert len(wm) == len(old) - 2 + d.experts * 12
    assert not any(k in wm for k in graft.FUSED)
    for f in dest.iterdir():
        if f.suffix == ".safetensors":
            assert not any(k in read_header(f).tensors for k in graft.FUSED)
    cfg = json.loads((dest / "config.json").read_text())["quantization_config"]["ignore"]
    hq = json.loads((dest / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    # the hybrid dropped the 3 side-layer globs (FP8_PB_WO, MIXED_PRECISION); the graft: 2 blanket → 29 names
    assert cfg == hq and len(cfg) == 13 - 3 - 2 + 29 == 37
    assert "mtp.*" not in cfg and "model.mtp.*" not in cfg
    assert {"mtp.fc_embedding", "mtp.fc_hidden", "mtp.layers.0.self_attn.q_proj"} <= set(cfg)
    hyb_cfg = json.loads((hyb / "config.json").read_text())["quantization_config"]["ignore"]
    assert cfg[:8] == [x for x in hyb_cfg if x not in graft.BLANKET]  # order of the rest kept
    for name in ("config.json", "hf_quant_config.json"):
        c = json.loads((dest / name).read_text())
        q = c["quantization_config"] if name == "config.json" else c["quantization"]
        assert q["quant_algo"] == "MIXED_PRECISION"
        assert q["quantized_layers"]["mtp.layers.0.mlp.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
        hq_hyb = json.loads((hyb / name).read_text())
        hq_hyb = hq_hyb["quantization_config"] if name == "config.json" else hq_hyb["quantization"]
        assert {k: v for k, v in q["quantized_layers"].items() if k != "mtp.layers.0.mlp.experts"} == \
            hq_hyb["quantized_layers"]  # the hybrid's FP8_PB_WO + NVFP4 entries carried over unchanged
    donor_link = dest / "nvfp4_experts_mtp.safetensors"
    assert donor_link.is_symlink() and not os.path.isabs(os.readlink(donor_link))
    assert "models--Inferact--" in os.path.realpath(donor_link)
    m = json.loads((dest / ".prepared").read_text())
    assert m["donor_sha256"] == donor.sha256 and m["added_keys"] == d.experts * 12
    assert verify.structure(dest).ok
    assert hfcache.variant_state(snap, "hybrid-mtp") == "ready"
    assert graft.prepare(snap, settings, donor=donor)["action"] == "none"
    # rebuilding the hybrid makes the graft stale
    hybrid.prepare(snap, force=True)
    assert hfcache.variant_state(snap, "hybrid-mtp") == "stale"


def test_graft_refuses_nvidia_and_missing_hybrid(tmp_path):
    cache = tmp_path / "hf"
    snap = ckpt.write_snapshot(cache, "nvidia")
    s = resolve(overrides={"MODEL": ckpt.NVIDIA, "HF_CACHE": str(cache)})
    with pytest.raises(ConfigError, match="RadixArk"):
        graft.prepare(snap, s)
    snap = ckpt.write_snapshot(cache, "radixark")
    s = resolve(overrides={"MODEL": ckpt.RADIXARK, "HF_CACHE": str(cache)})
    with pytest.raises(WeightsMissing, match="hybrid"):
        graft.prepare(snap, s)


def test_donor_sha_mismatch_is_refused_and_nothing_built(ready):
    snap, settings, donor = ready
    bad = graft.Donor(revision=donor.revision, sha256="0" * 64)
    with pytest.raises(graft.CheckpointError, match="pinned"):
        graft.prepare(snap, settings, donor=bad)
    assert not hfcache.variant_dir(snap, "hybrid-mtp").exists()


def test_exclude_lists_must_hold_exactly_the_blanket_globs(ready):
    snap, settings, donor = ready
    hyb = hfcache.variant_dir(snap, "hybrid")
    hq = json.loads((hyb / "hf_quant_config.json").read_text())
    hq["quantization"]["exclude_modules"].append("mtp.fc_embedding")
    (hyb / "hf_quant_config.json").unlink()
    (hyb / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(graft.CheckpointError, match="explicit mtp"):
        graft.build(snap, hfcache.repo_dir(settings["HF_CACHE"], donor.repo) / "snapshots" / DONOR_REV
                    / donor.filename, donor)
    assert not hfcache.variant_dir(snap, "hybrid-mtp").exists()


def test_wrong_donor_file_is_refused(ready, tmp_path):
    snap, settings, donor = ready
    wrong = hfcache.variant_dir(snap, "hybrid") / "model-bf16-00012.safetensors"
    with pytest.raises(graft.CheckpointError, match="not an mtp"):
        graft.build(snap, wrong, donor)
