"""fp8 hybrid on tiny layout-faithful checkpoints (both layouts, real data, real HF cache layout)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fakes import ckpt
from flash_cli import hfcache
from flash_cli.checkpoint import fp8, hybrid, layout, stwriter, verify
from flash_cli.errors import ConfigError, WeightsMissing
from flash_common.stheader import read_header

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["radixark", "nvidia"])
def snap(request, tmp_path):
    return ckpt.write_snapshot(tmp_path / "hf", request.param)


def _raw(path: Path, name: str, header=None) -> bytes:
    t = (header or read_header(path)).tensors[name]
    with open(path, "rb") as f:
        f.seek(t.begin)
        return f.read(t.nbytes)


def test_build_layout_values_and_marker(snap):
    out = hybrid.prepare(snap)
    assert out["action"] == "built"
    var = hfcache.variant_dir(snap, "hybrid")
    marker = json.loads((var / ".prepared").read_text())
    idx = json.loads((snap / layout.INDEX).read_text())["weight_map"]
    targets = sorted(k for k in idx if layout.SIDE_LAYER.fullmatch(k))
    assert marker["tensors"] == len(targets) == 52  # 6 GDN×3 + 2 QSA×5 + 8 shared×3 in the tiny model
    assert marker["source_revision"] == snap.name and marker["convention"] == "FP8_PB_WO"
    assert 0 < marker["worst_block_rel_err"] <= fp8.REL_ERR_BOUND * (1 + 1e-5)
    rewritten = set(marker["rewritten"])
    assert rewritten == {idx[t] for t in targets}
    for p in var.iterdir():
        if p.name in rewritten or p.name in (layout.INDEX, ".prepared", "fp8_convert.log", *hybrid.CONFIGS):
            assert not p.is_symlink() and oct(p.stat().st_mode & 0o777) == "0o644"
        else:  # relative link into the cache's blobs, same target as the snapshot's
            assert p.is_symlink() and not os.path.isabs(os.readlink(p))
            assert os.path.realpath(p) == os.path.realpath(snap / p.name)
    new_idx = json.loads((var / layout.INDEX).read_text())
    assert set(new_idx["weight_map"]) == set(idx) | {t + "_scale" for t in targets}
    assert new_idx["metadata"]["total_size"] == sum((var / f).stat().st_size for f in set(new_idx["weight_map"].values()))
    # every target: the exact quantization of its source bytes; everything else byte-identical
    for fname in rewritten:
        src, dst = snap / fname, var / fname
        hs, hd = read_header(src), read_header(dst)
        for name, t in hs.tensors.items():
            if name in targets:
                conv = fp8.quantize_bf16(_raw(src, name, hs), t.shape)
                assert hd.tensors[name].dtype == "F8_E4M3" and hd.tensors[name].shape == t.shape
                assert _raw(dst, name, hd) == conv.weight
                s = hd.tensors[name + "_scale"]  # ModelOpt FP8_PB_WO: 4-D, the 2-D grid's bytes
                assert s.dtype == "F32" and s.shape == (t.shape[0] // 128, 1, t.shape[1] // 128, 1)
                assert _raw(dst, name + "_scale", hd) == conv.scale
                assert name + "_scale_inv" not in hd.tensors
            else:
                assert _raw(dst, name, hd) == _raw(src, name, hs)
        assert hd.metadata == hs.metadata
    # the safetensors library reads what we wrote (non-F8 tensors by value)
    from safetensors import safe_open

    for fname in rewritten:
        with safe_open(str(var / fname), "np") as f:
            keys = set(f.keys())
            scale_key = next(t + "_scale" for t in targets if t + "_scale" in keys)
            assert f.get_tensor(scale_key).dtype == np.float32 and f.get_tensor(scale_key).ndim == 4
    assert verify.structure(var).ok
    assert hfcache.variant_state(snap, "hybrid") == "ready"


def _quant_sections(directory: Path) -> dict:
    cfg = json.loads((directory / "config.json").read_text())
    hq = json.loads((directory / "hf_quant_config.json").read_text())
    return {"config.json": cfg["quantization_config"], "hf_quant_config.json": hq["quantization"]}


def _excluded(name: str, patterns: list) -> bool:
    import fnmatch

    vllm = name.replace("model.language_model.", "model.", 1)
    return any(p in n or fnmatch.fnmatchcase(n, p) for p in patterns for n in (name, vllm))


def test_configs_become_mixed_precision_fp8_pb_wo(snap):
    """What vLLM's ModelOpt MIXED_PRECISION dispatch needs (patch 6 ships no code): every converted
    module FP8_PB_WO in quantized_layers and matched by no exclude pattern; experts stay NVFP4."""
    before = _quant_sections(snap)
    hybrid.prepare(snap)
    var = hfcache.variant_dir(snap, "hybrid")
    after = _quant_sections(var)
    idx = json.loads((snap / layout.INDEX).read_text())["weight_map"]
    modules = sorted(k[: -len(".weight")] for k in idx if layout.SIDE_LAYER.fullmatch(k))
    n_layers = json.loads((snap / "config.json").read_text())["text_config"]["num_hidden_layers"]
    for where, q in after.items():
        assert q["quant_algo"] == "MIXED_PRECISION", where
        excl = (q.get("ignore") or []) + (q.get("exclude_modules") or [])
        for m in modules:
            assert q["quantized_layers"][m] == {"quant_algo": "FP8_PB_WO", "group_size": 128}, (where, m)
            assert not _excluded(m, excl), (where, m)
            # the fused vLLM modules are not excluded either (is_layer_skipped checks shards)
            assert not _excluded(m.replace("in_proj_qkv", "in_proj_qkvz").replace("gate_proj", "gate_up_proj"), excl)
        for i in range(n_layers):
            assert q["quantized_layers"][f"model.language_model.layers.{i}.mlp.experts"] == \
                {"quant_algo": "NVFP4", "group_size": 16}, where
        # what stays BF16 is excluded exactly as before: head, embedding, MTP layer, vision, routers, PLE
        old = (before[where].get("ignore") or []) + (before[where].get("exclude_modules") or [])
        for keep in ("lm_head", "model.language_model.embed_tokens", "mtp.layers.0.self_attn.q_proj",
                     "model.visual.blocks.0.attn.qkv", "model.language_model.layers.0.mlp.gate",
                     "model.language_model.layers.1.ple.key_proj"):
            assert _excluded(keep, excl) == _excluded(keep, old), (where, keep)
        assert _excluded("lm_head", excl)
        # nothing that was quantized_layers before changed
        for k, v in (before[where].get("quantized_layers") or {}).items():
            assert q["quantized_layers"][k] == v
        added_experts = n_layers if before[where]["quant_algo"] == "NVFP4" else 0
        assert len(q["quantized_layers"]) == len(before[where].get("quantized_layers") or {}) + len(modules) + added_experts
    ex = [q.get("ignore") or q.get("exclude_modules") for q in after.values()]
    assert ex[0] == ex[1]  # identical before, identical after (the graft requires it)
    assert before["config.json"]["quant_algo"] != "NVFP4" or set(before["config.json"]["ignore"]) - set(ex[0]) == \
        {"*.self_attn.*", "*.linear_attn.*", "*.mlp.shared_expert.*"}
    m = json.loads((var / ".prepared").read_text())
    assert m["quant_config"]["fp8_pb_wo_layers"] == len(modules) and m["format"] == hfcache.VARIANT_FORMAT["hybrid"] == 2
    # the snapshot's own configs are untouched (the variant has real copies, not links)
    assert _quant_sections(snap) == before and not (var / "config.json").is_symlink()


def test_format_1_variant_is_stale_and_rebuilt(tmp_path):
    snap = ckpt.write_snapshot(tmp_path / "hf", "radixark")
    hybrid.prepare(snap)
    var = hfcache.variant_dir(snap, "hybrid")
    m = json.loads((var / ".prepared").read_text())
    m["format"], m["convention"] = 1, "dispatch-2d"
    (var / ".prepared").write_text(json.dumps(m))
    assert hfcache.variant_state(snap, "hybrid") == "stale"
    assert hybrid.prepare(snap, dry_run=True)["action"] == "build"
    assert hybrid.prepare(snap)["action"] == "built"
    assert json.loads((var / ".prepared").read_text())["format"] == 2


def test_refuses_a_source_that_already_has_dispatch_2d_scales(tmp_path):
    snap = ckpt.write_snapshot(tmp_path / "hf", "radixark")
    idx = json.loads((snap / layout.INDEX).read_text())
    k = next(k for k in idx["weight_map"] if layout.SIDE_LAYER.fullmatch(k))
    idx["weight_map"][k + "_scale_inv"] = idx["weight_map"][k]
    (snap / layout.INDEX).unlink()
    (snap / layout.INDEX).write_text(json.dumps(idx))
    with pytest.raises(layout.CheckpointError, match="already has fp8 side layers"):
        hybrid.plan(snap, hfcache.variant_dir(snap, "hybrid"))


def test_second_run_is_a_noop_and_fast(snap):
    hybrid.prepare(snap)
    var = hfcache.variant_dir(snap, "hybrid")
    before = {p.name: p.stat().st_mtime_ns for p in var.iterdir() if not p.is_symlink()}
    t0 = time.monotonic()
    assert hybrid.prepare(snap)["action"] == "none"
    assert time.monotonic() - t0 < 2
    assert before == {p.name: p.stat().st_mtime_ns for p in var.iterdir() if not p.is_symlink()}


def test_dry_run_plans_exact_sizes_and_writes_nothing(snap):
    out = hybrid.prepare(snap, dry_run=True)
    assert out["action"] == "build"
    assert not hfcache.variant_dir(snap, "hybrid").exists()
    plan = out["plan"]
    hybrid.prepare(snap)
    var = hfcache.variant_dir(snap, "hybrid")
    for r in plan["rewrite"]:
        assert (var / r["file"]).stat().st_size == r["bytes_after"]


def test_refuses_incomplete_snapshot_naming_files(tmp_path):
    snap = ckpt.write_snapshot(tmp_path / "hf", "radixark")
    os.unlink(os.path.realpath(snap / "model-bf16-00011.safetensors"))
    (snap / "chat_template.jinja").unlink()
    with pytest.raises(WeightsMissing) as err:
        hybrid.prepare(snap)
    assert "chat_template.jinja" in str(err.value) and "model-bf16-00011.safetensors" in str(err.value)
    assert not hfcache.variant_dir(snap, "hybrid").exists()


def test_refuses_compressed_tensors_pointing_to_published(tmp_path):
    snap = ckpt.write_snapshot(tmp_path / "hf", "radixark")
    cfg = json.loads((snap / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}}
    (snap / "config.json").unlink()
    (snap / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        hybrid.prepare(snap)
    assert "compressed-tensors" in str(err.value) and "published" in err.value.hint


def test_stale_marker_is_rebuilt_and_missing_link_repaired(tmp_path):
    snap = ckpt.write_snapshot(tmp_path / "hf", "radixark")
    hybrid.prepare(snap)
    var = hfcache.variant_dir(snap, "hybrid")
    # the snapshot gained a file after preparation → links added, nothing rebuilt
    extra = snap / "video_preprocessor_config.json"
    extra.write_text("{}")
    assert hfcache.variant_state(snap, "hybrid") == "stale"
    out = hybrid.prepare(snap)
    assert out["action"] == "repaired" and out["added"] == ["video_preprocessor_config.json"]
    assert hfcache.variant_state(snap, "hybrid") == "ready"
    # a marker from another revision → full rebuild
    m = json.loads((var / ".prepared").read_text())
    m["source_revision"] = "0" * 40
    (var / ".prepared").write_text(json.dumps(m))
    assert hybrid.prepare(snap)["action"] == "built"
    assert json.loads((var / ".prepared").read_text())["source_revision"] == snap.name
    # a rewritten shard deleted → rebuild, not repair
    (var / "model-bf16-00010.safetensors").unlink()
    assert hybrid.prepare(snap)["action"] == "built"
    assert verify.structure(var).ok


def test_out_of_disk_midway_leaves_nothing_marked(tmp_path):
    snap = ckpt.write_snapshot(tmp_path / "hf", "radixark")
    p = hybrid.plan(snap, hfcache.variant_dir(snap, "hybrid"))
    written = [0]

    def enospc(n):
        written[0] += n
        if written[0] > 3_000_000:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        hybrid.build(p, on_write=enospc)
    siblings = [d.name for d in snap.parent.iterdir() if d.name != snap.name]
    assert siblings == []  # no variant, no partial dir left
    assert hybrid.prepare(snap)["action"] == "built" and verify.structure(hfcache.variant_dir(snap, "hybrid")).ok


def test_disk_preflight_refuses_before_writing(tmp_path, monkeypatch):
    snap = ckpt.write_snapshot(tmp_path / "hf", "nvidia")
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000_000))
    with pytest.raises(hybrid.CheckpointError, match="not enough disk"):
        hybrid.prepare(snap)
    assert [d.name for d in snap.parent.iterdir()] == [snap.name]


# The child SIGKILLs itself at an exact point of the real build (all threads die at once, as
# with an OOM kill or a power cut): deterministic, so the test cannot drift into killing a
# process that is still starting up or already done.
KILL_CHILD = """
import os, signal, sys
from pathlib import Path
from flash_cli.checkpoint import hybrid, stwriter
what, n = sys.argv[2], int(sys.argv[3])
calls = {"n": 0}
def hook(orig, match=lambda *a: True):
    def wrapper(*a, **k):
        if match(*a):
            calls["n"] += 1
            if calls["n"] == n:
                os.kill(os.getpid(), signal.SIGKILL)
        return orig(*a, **k)
    return wrapper
W = stwriter.PositionalWriter
if what == "write":   # a converted strip being written by a worker thread
    W.write_at = hook(W.write_at)
elif what == "copy":  # an untouched tensor being copied into a rewritten shard
    W.copy_into = hook(W.copy_into)
elif what == "close": # a rewritten shard being closed (ftruncate + fsync)
    W.close = hook(W.close)
elif what == "rename":  # inside the swap: .prepared is in the partial dir, renames pending
    os.rename = hook(os.rename, lambda src, dst: True)
hybrid.prepare(Path(sys.argv[1]))
"""


@pytest.mark.parametrize("what, n, stale", [
    ("write", 1, False), ("write", 150, False), ("copy", 2, False), ("close", 3, False),
    ("rename", 1, False),  # fresh build: the only rename is partial -> variant
    ("rename", 2, True),   # rebuild of a stale variant: killed between variant -> .old and partial -> variant
])
def test_killed_at_any_point_then_rerun_verifies(tmp_path, what, n, stale):
    snap = ckpt.write_snapshot(tmp_path / "hf", "radixark", ckpt.with_layers(ckpt.TINY, 24))
    var = hfcache.variant_dir(snap, "hybrid")
    partial = var.with_name(var.name + hybrid.PARTIAL)
    if stale:
        hybrid.prepare(snap)
        m = json.loads((var / ".prepared").read_text())
        (var / ".prepared").write_text(json.dumps({**m, "format": m["format"] - 1}))
        assert hfcache.variant_state(snap, "hybrid") == "stale"
    proc = subprocess.run([sys.executable, "-c", KILL_CHILD, str(snap), what, str(n)], capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]  # it died at the point, not before/after
    assert partial.is_dir()  # killed mid-build: the work in progress is there ...
    assert hfcache.variant_state(snap, "hybrid") != "ready"  # ... and nothing claims to be prepared
    if what == "rename" and stale:
        assert not var.exists() and var.with_name(var.name + ".old").is_dir()
    elif stale:
        assert hfcache.variant_state(snap, "hybrid") == "stale"
    out = hybrid.prepare(snap)
    assert out["action"] == "built"
    assert not partial.exists() and not var.with_name(var.name + ".old").exists()
    assert verify.structure(var).ok and hfcache.variant_state(snap, "hybrid") == "ready"


def test_unaligned_target_is_refused_before_writing(tmp_path):
    d = ckpt.TINY
    snap = ckpt.write_snapshot(tmp_path / "hf", "radixark", ckpt.Dims(**{**d.__dict__, "shared_inter": 96}))
    with pytest.raises(hybrid.CheckpointError, match="divisible by 128"):
        hybrid.prepare(snap)
    assert [x.name for x in snap.parent.iterdir()] == [snap.name]


def test_row_strips_and_worker_counts_do_not_change_a_byte(tmp_path, monkeypatch):
    a = ckpt.write_snapshot(tmp_path / "a", "radixark")
    hybrid.build(hybrid.plan(a, hfcache.variant_dir(a, "hybrid")), workers=1)
    monkeypatch.setattr(fp8, "STRIP_ELEMS", 128 * 256)  # several strips per tensor, scales concatenated
    monkeypatch.setattr(stwriter, "BEHIND_BYTES", 8192)  # write-behind waits and drops pages all the time
    b = ckpt.write_snapshot(tmp_path / "b", "radixark")
    hybrid.build(hybrid.plan(b, hfcache.variant_dir(b, "hybrid")), workers=3)
    va, vb = hfcache.variant_dir(a, "hybrid"), hfcache.variant_dir(b, "hybrid")
    rewritten = json.loads((va / ".prepared").read_text())["rewritten"]
    for name in rewritten:
        assert (va / name).read_bytes() == (vb / name).read_bytes()


def test_prepare_hybrid_on_any_directory_same_result(tmp_path):
    """`flash prepare hybrid --source DIR [--dest DIR]` (what tools/fp8_convert.py was): the same
    bytes as the snapshot's own variant, next to a plain directory copy."""
    import shutil as sh

    snap = ckpt.write_snapshot(tmp_path / "hf", "nvidia")
    plain = tmp_path / "plain"  # a plain directory copy, not a cache snapshot
    sh.copytree(snap, plain, symlinks=False)
    cmd = [sys.executable, "-m", "flash_cli", "prepare", "hybrid"]
    dry = subprocess.run(cmd + ["--source", str(plain), "--dry-run"], capture_output=True, text=True, cwd=ROOT)
    assert dry.returncode == 0 and "52 tensors" in dry.stderr and not (tmp_path / "plain-fp8hybrid").exists()
    out = subprocess.run(cmd + ["--source", str(plain)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "worst block rel err 0.03" in out.stderr and out.stdout == f"{tmp_path / 'plain-fp8hybrid'}\n"
    elsewhere = subprocess.run(cmd + ["--source", str(plain), "--dest", str(tmp_path / "out" / "v")],
                               capture_output=True, text=True, cwd=ROOT)
    assert elsewhere.returncode == 0 and (tmp_path / "out" / "v" / ".prepared").is_file(), elsewhere.stderr
    hybrid.prepare(snap)
    a, b = tmp_path / "plain-fp8hybrid", hfcache.variant_dir(snap, "hybrid")
    for name in json.loads((b / ".prepared").read_text())["rewritten"]:
        assert (a / name).read_bytes() == (b / name).read_bytes() == (tmp_path / "out" / "v" / name).read_bytes()
    bad = subprocess.run(cmd + ["--source", str(tmp_path / "nowhere")], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 5 and "Traceback" not in bad.stderr
    misuse = subprocess.run([*cmd[:-1], "graft", "--source", str(plain)], capture_output=True, text=True, cwd=ROOT)
    assert misuse.returncode == 2 and "--source/--dest: prepare hybrid only" in misuse.stderr


@pytest.mark.parametrize("bits", [0x7FC0, 0xFF80], ids=["nan", "-inf"])
def test_non_finite_weight_is_refused_naming_the_tensor(tmp_path, monkeypatch, bits):
    monkeypatch.setattr(fp8, "STRIP_ELEMS", 128 * 128)  # one block row per strip: the error names it
    snap = ckpt.write_snapshot(tmp_path / "hf", "radixark")
    p = hybrid.plan(snap, hfcache.variant_dir(snap, "hybrid"))
    fp, tgt = next((fp, src[1]) for fp in p.files for _, src in fp.entries
                   if src[0] == "weight" and src[1].shape[0] >= 256)
    k = tgt.shape[1]
    with open(os.path.realpath(p.source / fp.name), "r+b") as f:  # the blob behind the snapshot link
        f.seek(tgt.begin + (130 * k + 5) * 2)  # row 130: the second block row
        f.write(int(bits).to_bytes(2, "little"))
    with pytest.raises(hybrid.CheckpointError, match=rf"{re.escape(tgt.name)} holds inf or NaN in rows 128–255"):
        hybrid.build(p)
    assert [d.name for d in snap.parent.iterdir()] == [snap.name]  # nothing built, nothing marked


def test_linked_headers_read_during_the_write_give_the_same_verdict(tmp_path):
    snap = ckpt.write_snapshot(tmp_path / "hf", "nvidia")
    p = hybrid.plan(snap, hfcache.variant_dir(snap, "hybrid"))
    hybrid.build(p)
    var = hfcache.variant_dir(snap, "hybrid")
    known = hybrid.linked_headers(p)
    linked_shards = set(p.weight_map.values()) & set(p.linked)
    assert linked_shards and set(known) == linked_shards
    a, b = verify.structure(var), verify.structure(var, known_headers=known)
    assert a.ok and b.ok and (a.files, a.keys, a.tensors) == (b.files, b.keys, b.tensors)
    # the rewritten shards are always read from the variant: a broken one still fails the gate
    victim = var / p.files[0].name
    victim.write_bytes(victim.read_bytes()[:1000])
    assert any(p.files[0].name in x for x in hybrid.check_built(p, var, known))
    # a linked shard whose header is broken or points past its end is left to the full read
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((50).to_bytes(8, "little") + b'{"a":{"dtype":"U8","shape":[99],"data_offsets":[0,99]}}'[:50])
    assert hybrid._linked_header(bad) is None
    bad.write_bytes((56).to_bytes(8, "little") + b'{"a":{"dtype":"U8","shape":[99],"data_offsets":[0,99]}}'.ljust(56))
    assert hybrid._linked_header(bad) is None
    bad.write_bytes(bad.read_bytes() + b"\0" * 99)
    assert set(hybrid._linked_header(bad).tensors) == {"a"}
