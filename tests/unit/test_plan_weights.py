"""Weights by component: geometry against the published checkpoint sizes, headers on a synthetic
snapshot with the real tensor names."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from flash_cli.plan import weights as W
from flash_cli.geometry import REAL, from_config

GIB = 1024**3
BITS = {"BF16": 16, "F32": 32, "U8": 8, "F8_E4M3": 8, "I64": 64}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = BITS[dtype] // 8
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_geometry_reproduces_the_published_payloads():
    # the published checkpoints' headers: tensor payload 132,639,846,394 B (nvidia) and 135,156,121,594 B
    # (RadixArk); the two differ only by the MTP experts (fp8 vs bf16)
    for kind, payload in (("nvidia", 132_639_846_394), ("radixark", 135_156_121_594)):
        w = W.geometry_estimate(REAL, checkpoint=kind, mode="nvfp4", mtp=1, draft_vocab=False, vision=True)
        assert sum(w.on_disk.values()) == pytest.approx(payload, rel=1e-4)


def test_component_sizes_match_the_field():
    w = W.geometry_estimate(REAL, checkpoint="radixark", mode="nvfp4", mtp=1, draft_vocab=True, vision=True)
    assert w.components["vision"] / GIB == pytest.approx(0.836, rel=0.01)  # seed 004
    assert w.components["mtp_experts"] / GIB == pytest.approx(4.69, rel=0.01)  # seed 004
    assert w.on_disk["ple_table"] == 51_200_245_760  # §2.2
    assert w.components["ple_table"] == 0  # mmapped, not on the GPU
    assert w.components["draft_head_copy"] == 65_536 * 2560 * 2


def test_modes_and_checkpoints_move_the_right_component():
    est = lambda **kw: W.geometry_estimate(REAL, **{"checkpoint": "radixark", "mode": "hybrid", "mtp": 2,
                                                     "draft_vocab": True, "vision": True, **kw})
    hybrid, nvfp4 = est(), est(mode="nvfp4")
    # 2,929,459,200 side-layer params: bf16 → fp8 + F32 [N/128, K/128] scales
    assert nvfp4.components["side_layers"] - hybrid.components["side_layers"] == 2_929_459_200 - 178_800 * 4
    graft = est(mode="hybrid-mtp")
    assert (hybrid.total - graft.total) / GIB == pytest.approx(3.37, abs=0.05)  # bf16 → NVFP4 draft experts
    assert est(checkpoint="nvidia").components["mtp_experts"] == 512 * 3 * (640 * 2560 + 5 * 20 * 2)
    assert est(mtp=0).components["mtp_experts"] == 0 and est(mtp=0).components["draft_head_copy"] == 0
    assert est(vision=False).components["vision"] == 0


def test_classify_real_names():
    c = W.classify
    assert c("model.language_model.layers.5.mlp.experts.17.down_proj.weight_scale") == "routed_experts"
    assert c("model.language_model.layers.4.linear_attn.in_proj_qkv.weight") == "side_layers"
    assert c("model.language_model.layers.3.self_attn.indexer.index_qk_proj.weight_scale_inv") == "side_layers"
    assert c("model.language_model.layers.4.linear_attn.in_proj_qkv.weight_scale") == "side_layers"  # FP8_PB_WO hybrid
    assert c("model.language_model.layers.4.linear_attn.in_proj_a.weight_scale") == "other_dense"
    assert c("model.language_model.layers.4.linear_attn.in_proj_a.weight") == "other_dense"
    assert c("model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_7.weight") == "ple_table"
    assert c("model.language_model.layers.1.ple.key_proj.weight") == "ple_projections"
    assert c("mtp.layers.0.mlp.experts.3.up_proj.weight") == "mtp_experts"
    assert c("mtp.fc.weight") == "mtp_dense"
    assert c("model.visual.blocks.0.attn.qkv.weight") == "vision"
    assert c("model.language_model.layers.0.attn_hyper_connection.hc_norm.weight") == "hyper_connections"
    assert c("lm_head.weight") == "lm_head" and c("model.language_model.embed_tokens.weight") == "embeddings"


def make_snapshot(root: Path) -> Path:
    snap = root / "snap"
    snap.mkdir()
    a = {
        "model.language_model.layers.0.mlp.experts.0.gate_proj.weight": ("U8", [4, 8]),
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight": ("BF16", [256, 128]),
        "model.language_model.embed_tokens.weight": ("BF16", [16, 8]),
        "lm_head.weight": ("BF16", [16, 8]),
        "stray.weight": ("BF16", [4]),  # in the file, not in the index: never loaded
    }
    b = {
        "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight": ("F8_E4M3", [10, 160]),
        "model.language_model.layers.1.ple.key_proj.weight": ("BF16", [8, 8]),
        "model.visual.blocks.0.attn.qkv.weight": ("BF16", [8, 8]),
        "mtp.layers.0.mlp.experts.0.down_proj.weight": ("F8_E4M3", [4, 4]),
        "mtp.fc.weight": ("BF16", [8, 8]),
        "model.language_model.layers.0.mlp.gate.weight": ("BF16", [4, 8]),
    }
    write_safetensors(snap / "model-1.safetensors", a)
    write_safetensors(snap / "model-2.safetensors", b)
    wm = {k: "model-1.safetensors" for k in a if k != "stray.weight"} | {k: "model-2.safetensors" for k in b}
    (snap / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return snap


def test_headers_sum_per_component(tmp_path):
    snap = make_snapshot(tmp_path)
    w = W.from_headers(snap, REAL, mode="nvfp4", mtp=2, draft_vocab=False, vision=True, prepared=True)
    c = w.components
    assert (c["routed_experts"], c["side_layers"], c["embeddings"], c["lm_head"]) == (32, 65_536, 256, 256)
    assert (c["ple_projections"], c["vision"], c["mtp_experts"], c["mtp_dense"], c["other_dense"]) == (128, 128, 16, 128, 64)
    assert c["ple_table"] == 0 and w.on_disk["ple_table"] == 1600
    assert w.source.startswith("headers:")


def test_headers_unprepared_hybrid_converts_side_layers_on_paper(tmp_path):
    snap = make_snapshot(tmp_path)
    w = W.from_headers(snap, REAL, mode="hybrid", mtp=0, draft_vocab=True, vision=False, prepared=False)
    assert w.components["side_layers"] == 256 * 128 + 2 * 1 * 4  # fp8 + F32 [2, 1] scales
    assert w.components["mtp_experts"] == w.components["mtp_dense"] == w.components["vision"] == 0
    assert any("not prepared" in n for n in w.notes)


def test_config_json_overrides_the_geometry(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"text_config": {"num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                                               "ple_layer_ids": [2], "mamba_ssm_dtype": "bfloat16"},
                               "vision_config": {"depth": 2}}))
    g = from_config(cfg)
    assert (g.num_hidden_layers, g.qsa_layers, g.mamba_ssm_dtype_bytes, g.vision_depth) == (8, 2, 2, 2)
    assert g.hidden_size == REAL.hidden_size


def test_header_summary_is_cached_and_invalidated(tmp_path):
    snap = make_snapshot(tmp_path)
    kw = dict(mode="nvfp4", mtp=2, draft_vocab=False, vision=True, prepared=True)
    first = W.from_headers(snap, REAL, **kw)
    second = W.from_headers(snap, REAL, **kw)
    assert "(cached summary)" not in first.notes[0] and "(cached summary)" in second.notes[0]
    assert first.components == second.components
    # a shard rewritten with another size is read again
    write_safetensors(snap / "model-2.safetensors", {"model.language_model.layers.0.mlp.gate.weight": ("BF16", [8, 8])})
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.language_model.layers.0.mlp.gate.weight": "model-2.safetensors"}}))
    third = W.from_headers(snap, REAL, **kw)
    assert "(cached summary)" not in third.notes[0] and third.components["other_dense"] == 128
