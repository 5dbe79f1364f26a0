"""hfcache.index_files / missing_files apply the path-traversal rule the other index readers use
(issue 14): a weight_map entry that leaves the snapshot never makes a snapshot look complete."""

from __future__ import annotations

import json

import pytest

from flash_cli import hfcache

from test_checkpoint_hfcache import REV_A, make_snapshot


@pytest.mark.parametrize("evil", ["../../blobs/outside.safetensors", "/etc/hostname", "sub/../../x", "a\\..\\..\\x"])
def test_index_entry_outside_the_snapshot_is_reported(tmp_path, evil):
    snap = make_snapshot(tmp_path, "o/m", REV_A)
    (snap.parent.parent / "blobs" / "outside.safetensors").write_text("x")  # exists: is_file() alone says "fine"
    idx = snap / hfcache.INDEX
    idx.unlink()
    idx.write_text(json.dumps({"metadata": {}, "weight_map": {"t0": "model-1.safetensors", "t1": evil}}))
    assert hfcache.index_files(snap) is None
    miss = hfcache.missing_files(snap)
    assert len(miss) == 1 and "outside the snapshot" in miss[0] and repr(evil) in miss[0]
    assert hfcache.variant_state(snap, "nvfp4") == "stale"


def test_safe_names_still_listed(tmp_path):
    snap = make_snapshot(tmp_path, "o/m", REV_A, shards=("a.safetensors", "b.safetensors"))
    assert hfcache.index_files(snap) == ["a.safetensors", "b.safetensors"]
    assert hfcache.missing_files(snap) == []
