"""The QAD export NVIDIA's one-Spark recipe serves (local-inference-lab/Qwen3.8-Flash-Next-NVFP4,
nvidia/Qwen3.8-Flash-Next-FP4-Local): its layout recognised from the index, downloaded (serving
files only) through real huggingface_hub against the local Hub, verified, refused by the prepare
steps that do not apply, planned with its NVFP4 PLE table, and rendered."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fakes import ckpt
from fakes.hub import FakeHub
from flash_cli import hfcache, preflight, spec
from flash_cli.__main__ import main
from flash_cli.checkpoint import download, known, verify
from flash_cli.errors import ConfigError
from flash_cli.plan import build, ple_table_placement
from flash_cli.plan import hardware as H
from flash_cli.plan import weights as W
from flash_cli.geometry import Geometry
from flash_cli.settings import resolve

COMMIT = "0ad0" + "0" * 36
NGRAM = f"{ckpt.P}layers.1.ple.ple_embedding.ngram_embedding."


@pytest.fixture(scope="module")
def snaps(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {f: ckpt.write_snapshot(root / f, f) for f in ("qad", "nvidia", "radixark")}


@pytest.fixture
def hub(snaps, monkeypatch):
    h = FakeHub()
    h.add_dir(ckpt.QAD, snaps["qad"], COMMIT)
    h.add_dir(ckpt.FP4_LOCAL, snaps["qad"], COMMIT)
    h.start()
    monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", constants.HF_HUB_DISABLE_XET)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield h
    h.stop()


def _settings(**kw):
    return resolve(overrides={k: str(v) for k, v in kw.items()})


def test_each_layout_is_recognised_from_its_index_not_its_name(snaps):
    for flavour, snap in snaps.items():
        assert known.detect_dir(snap) == flavour
    # the name only speaks before anything is on disk; the index wins after
    assert known.for_model(ckpt.FP4_LOCAL).name == known.for_model(ckpt.QAD).name == "qad"
    assert known.layout_of("someone/mirror", snaps["qad"]).name == "qad"
    assert known.layout_of(ckpt.FP4_LOCAL, snaps["nvidia"]).name == "nvidia"
    assert known.for_model("someone/else") is None and known.layout_of("someone/else", None) is None


@pytest.mark.parametrize("model", [ckpt.QAD, ckpt.FP4_LOCAL])
def test_download_fetches_the_serving_files_then_verifies(hub, snaps, tmp_path, model):
    cache = tmp_path / "cache"
    s = _settings(MODEL=model, HF_CACHE=cache)
    p = download.plan(s)
    every = {f.name for f in snaps["qad"].iterdir()}
    assert p.excluded == ["README.md"]  # not a serving file (known.SERVING_FILES)
    assert {f.path for f in p.files} == every - {"README.md"}
    assert {f.path for f in p.files} >= {f"model-0000{k}-of-00006.safetensors" for k in range(1, 7)} | {"export-manifest.json"}
    snap = download.execute(p, s, progress=False)
    assert snap == hfcache.repo_dir(cache, model) / "snapshots" / COMMIT
    assert not (snap / "README.md").exists() and (snap / "export-manifest.json").is_file()
    res = verify.verify(snap, with_hash=True, progress=False)
    assert res.ok, res.problems
    assert res.keys == ckpt.tensor_count("qad", ckpt.TINY) and known.detect_dir(snap) == "qad"
    # what the hub was asked for: never the README
    assert not any("README.md" in path for _, path, _ in hub.requests)


def test_exclude_still_refuses_a_serving_file_for_this_layout(hub, tmp_path):
    with pytest.raises(ConfigError, match="export-manifest|would skip"):
        download.plan(_settings(MODEL=ckpt.QAD, HF_CACHE=tmp_path, EXCLUDE="*.safetensors"))


def test_verify_names_a_table_shard_without_its_block_scales(snaps):
    from flash_common.stheader import read_index

    wm = read_index(snaps["qad"])
    assert known.table_problems(wm) == []
    bad = {k: v for k, v in wm.items() if k != f"{NGRAM}shard_3.weight_scale"}
    assert known.table_problems(bad) == [f"PLE table: {NGRAM}shard_3.weight has no shard_3.weight_scale (NVFP4 block scales)"]
    no_codes = {k: v for k, v in wm.items() if not (k.startswith(NGRAM + "shard_") and k.endswith(".weight"))}
    assert any("no codes" in p for p in known.table_problems(no_codes))
    assert known.table_problems(read_index(snaps["nvidia"])) == []  # FP8 tables have no block scales


def test_a_missing_shard_file_fails_verify_naming_it(snaps, tmp_path):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(snaps["qad"], d, symlinks=False)
    (d / "model-00004-of-00006.safetensors").unlink()
    res = verify.verify(d)
    assert not res.ok and any("model-00004-of-00006.safetensors" in p for p in res.problems)


@pytest.mark.parametrize("what, word", [("hybrid", "MXFP8"), ("graft", "fused BF16 draft experts")])
def test_prepare_steps_that_do_not_apply_are_refused_naming_why(snaps, capsys, what, word):
    cache = snaps["qad"].parents[3]
    rc = main(["prepare", what, "--no-profile", f"MODEL={ckpt.QAD}", f"HF_CACHE={cache}", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and word in err and "MODE accepts nvfp4" in err
    assert not hfcache.variant_dir(snaps["qad"], "hybrid").exists()


def test_prepare_hybrid_on_a_directory_reads_the_layout_from_its_index(snaps, capsys, tmp_path):
    rc = main(["prepare", "hybrid", "--source", str(snaps["qad"]), "--dest", str(tmp_path / "out"), "--dry-run"])
    assert rc == 2 and "MXFP8" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_serve_preflight_refuses_a_hybrid_mode_and_serves_the_nvfp4_table_with_patch_1_on_v033(snaps):
    cache = snaps["qad"].parents[3]
    hyb = preflight.weights(_settings(MODEL=ckpt.QAD, HF_CACHE=cache, MODE="hybrid"), cache, snaps["qad"])
    assert any("MODE=hybrid does not apply" in p.message for p in hyb)
    # patch 1 on (the recipe's default) on v0.33: its NVFP4 codec serves the table from disk
    on = _settings(MODEL=ckpt.QAD, HF_CACHE=cache, MODE="nvfp4")
    assert on["BASE"] == "v0.33" and not spec.ple_patch_off(on)
    assert preflight.weights(on, cache, snaps["qad"]) == []
    off = _settings(MODEL=ckpt.QAD, HF_CACHE=cache, MODE="nvfp4", CONTAINER_ENV="VLLM_PLE_MMAP=0")
    assert preflight.layout_problems(off, snaps["qad"]) == []
    # vLLM has an NVFP4 table method from 0.33.0 on (Qwen4ExpPLENvFp4EmbeddingMethod), and patch 1
    # decodes on top of it: older bases have no path, with the patch off...
    old = _settings(MODEL=ckpt.QAD, HF_CACHE=cache, MODE="nvfp4", CONTAINER_ENV="VLLM_PLE_MMAP=0", BASE="v0.32")
    (p,) = preflight.layout_problems(old, snaps["qad"])
    assert p.message.startswith("vLLM cannot serve") and "on BASE=v0.32" in p.message and "0.33.0" in p.message
    assert "BASE=v0.33" in p.hint
    assert [q.message for q in preflight.weights(old, cache, snaps["qad"])] == [p.message]  # not the fp8 table's
    # ... or on
    for base in ("v0.29", "v0.30", "v0.32"):
        (q,) = preflight.layout_problems(_settings(MODEL=ckpt.QAD, HF_CACHE=cache, BASE=base), snaps["qad"])
        assert "patch 1 cannot serve" in q.message and f"BASE={base}" in q.message and "0.33.0" in q.message
        assert f"no serving path on BASE={base}" in q.hint and "BASE=v0.33" in q.hint
    # the published layouts keep patch 1 and every mode they had, on every base
    for base in ("v0.29", "v0.33"):
        nv = _settings(MODEL=ckpt.NVIDIA, HF_CACHE=cache, MODE="nvfp4", BASE=base)
        assert preflight.layout_problems(nv, snaps["nvidia"]) == []


def test_plan_reads_the_headers_and_puts_the_nvfp4_table_in_memory(snaps):
    cache = snaps["qad"].parents[3]
    s = _settings(MODEL=ckpt.QAD, HF_CACHE=cache, MODE="nvfp4", CONTAINER_ENV="VLLM_PLE_MMAP=0", YARN=0, CTX=1024)
    w = W.from_headers(snaps["qad"], Geometry(), mode="nvfp4", mtp=2, draft_vocab=False, vision=True,
                       prepared=True, table_on_gpu=True)
    d = ckpt.TINY
    table = d.ple_shards * d.ple_rows * (d.ple_width // 2 + d.ple_width // 16) + 4
    assert w.components["ple_table"] == w.on_disk["ple_table"] == table
    # MXFP8 side layers: one byte a value + one scale byte per 32 (the 13 exported projections)
    bf16 = [t for L in range(d.layers) for t in ckpt.layer_tensors(d, L)]
    side = sum(s[0] * (s[1] + s[1] // 32) for name, _, s in bf16 if W.classify(name) == "side_layers")
    assert w.components["side_layers"] == side
    on_gpu, note = ple_table_placement(s, snaps["qad"])
    assert on_gpu and "patch 1 is off" in note
    # patch 1 on: the NVFP4 table is read from disk like the FP8 ones, nothing of it on the GPU
    s_on = _settings(MODEL=ckpt.QAD, HF_CACHE=cache, MODE="nvfp4", YARN=0, CTX=1024)
    assert ple_table_placement(s_on, snaps["qad"])[0] is False
    w_on = W.from_headers(snaps["qad"], Geometry(), mode="nvfp4", mtp=2, draft_vocab=False, vision=True,
                          prepared=True, table_on_gpu=False)
    assert w_on.components["ple_table"] == 0 and w_on.on_disk["ple_table"] == table
    nv = _settings(MODEL=ckpt.NVIDIA, HF_CACHE=cache)
    assert ple_table_placement(nv, snaps["nvidia"])[0] is False


def test_plan_without_a_snapshot_uses_the_qad_geometry_for_either_name():
    for model in (ckpt.QAD, ckpt.FP4_LOCAL):
        p = build(_settings(MODEL=model, MODE="nvfp4", CONTAINER_ENV="VLLM_PLE_MMAP=0"), H.PRESETS["gb10"], snapshot=None)
        assert any("weights from the geometry for a qad checkpoint" in a for a in p["assumptions"])
        assert any("patch 1 is off" in a for a in p["assumptions"])
        on = build(_settings(MODEL=model, MODE="nvfp4"), H.PRESETS["gb10"], snapshot=None)
        assert any("mmapped from the checkpoint by the plugin (patch 1)" in a for a in on["assumptions"])
    g = Geometry()
    est = W.geometry_estimate(g, checkpoint="qad", mode="nvfp4", mtp=2, draft_vocab=False, vision=True, table_on_gpu=True)
    nv = W.geometry_estimate(g, checkpoint="nvidia", mode="nvfp4", mtp=2, draft_vocab=False, vision=True)
    assert est.on_disk["ple_table"] == 320_001_536 * 90 + 4 == est.components["ple_table"]  # 26.8 GiB vs 47.7 fp8
    assert nv.components["ple_table"] == 0 and nv.on_disk["ple_table"] == 320_001_536 * 160
    assert est.components["side_layers"] < nv.components["side_layers"]  # MXFP8 vs BF16


def test_render_serves_the_snapshot_as_published_with_the_table_left_to_vllm():
    s = _settings(MODEL=ckpt.FP4_LOCAL, MODE="nvfp4", CONTAINER_ENV="VLLM_PLE_MMAP=0")
    r = spec.build(s, profile="published", snapshot=COMMIT, hf_cache="/h", state_dir="/s")
    serve_at = r.command.index("serve") + 1
    assert r.command[serve_at] == f"/hf/hub/models--nvidia--Qwen3.8-Flash-Next-FP4-Local/snapshots/{COMMIT}"
    assert r.env["VLLM_PLE_MMAP"] == "0" and "VLLM_FP8_HYBRID" not in r.env
    assert r.labels["org.flash.model"] == ckpt.FP4_LOCAL


def test_no_layout_is_left_unproven_once_the_gpu_tier_has_booted_it(monkeypatch):
    """qad's NVFP4 table codec passed boot_d / ple_nvfp4_d in gpu-e2e run46 (fb2c46b): serve no longer
    warns for it, nor for any other layout; the mechanism stays for the next layout that arrives
    unproven (a warning naming the model and the way back to vLLM's own method)."""
    assert not [k for k, lay in known.LAYOUTS.items() if lay.unproven]
    on = spec.build(_settings(MODEL=ckpt.FP4_LOCAL, MODE="nvfp4"), profile="nvidia", snapshot=COMMIT,
                    hf_cache="/h", state_dir="/s")
    assert not [w for w in on.warnings if "has not run on a GPU" in w]
    unproven = dataclasses.replace(known.LAYOUTS["qad"], unproven="not on a GPU yet; VLLM_PLE_MMAP=0 is vLLM's method")
    monkeypatch.setitem(known.LAYOUTS, "qad", unproven)
    said = spec.build(_settings(MODEL=ckpt.FP4_LOCAL, MODE="nvfp4"), profile="nvidia", snapshot=COMMIT,
                      hf_cache="/h", state_dir="/s").warnings
    assert f"{ckpt.FP4_LOCAL}: not on a GPU yet; VLLM_PLE_MMAP=0 is vLLM's method" in said
    off = spec.build(_settings(MODEL=ckpt.FP4_LOCAL, MODE="nvfp4", CONTAINER_ENV="VLLM_PLE_MMAP=0"),
                     profile="nvidia", snapshot=COMMIT, hf_cache="/h", state_dir="/s").warnings
    assert not [w for w in off if "not on a GPU yet" in w]  # vLLM's own method: nothing of ours


def test_quant_configs_of_the_fixture_are_the_exports_groups(snaps):
    cfg = json.loads((snaps["qad"] / "config.json").read_text())["quantization_config"]
    assert cfg["quant_algo"] == "MIXED_PRECISION" and cfg["ignore"] == []
    assert set(cfg["config_groups"]) == {"group_nvfp4_routed_experts", "group_mxfp8_attention", "group_mxfp8_shared_experts"}
    assert cfg["quantized_layers"][f"{ckpt.P}layers.0.linear_attn.in_proj_qkv"] == {"quant_algo": "MXFP8", "group_size": 32}
