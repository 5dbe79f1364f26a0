"""Scale tier: the checkpoint pipeline on full-size sparse replicas (real names, shapes, dtypes,
file sizes and index sizes of both layouts; data are holes). Writes ~19 GB of real bytes (the
hybrid's and the graft's rewritten shards) and deletes them at the end."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fakes import ckpt
from flash_cli import hfcache
from flash_cli.checkpoint import graft, hybrid, layout, verify
from flash_cli.settings import resolve
from flash_common.stheader import read_header

pytestmark = pytest.mark.scale
ROOT = Path(__file__).resolve().parents[2]
GB = 1e9
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}  # this checkout, whatever is installed


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    free = shutil.disk_usage(d).free
    if free < 25 * GB:
        pytest.fail(f"the scale tier needs ~25 GB free under {d}, has {free / GB:.1f} GB")
    yield d / "hf"
    shutil.rmtree(d, ignore_errors=True)  # real bytes: never leave them to pytest's tmp retention


@pytest.fixture(scope="module")
def radixark(cache):
    return ckpt.write_snapshot(cache, "radixark", ckpt.REAL, sparse=True)


@pytest.fixture(scope="module")
def nvidia(cache):
    return ckpt.write_snapshot(cache, "nvidia", ckpt.REAL, sparse=True)


def test_replicas_have_the_published_inventory(radixark, nvidia):
    for snap, keys, files in ((radixark, 296_475, 206), (nvidia, 299_545, 11)):
        wm = json.loads((snap / layout.INDEX).read_text())["weight_map"]
        assert len(wm) == keys and len(set(wm.values())) == files
    h = read_header(nvidia / "model-fp8-mtp-ple.safetensors")  # 128 table shards + scale + 3,072 fp8 MTP tensors
    assert h.payload_bytes == 51_200_245_760 + 2 + 512 * 3 * 640 * 2560 + 512 * 3 * 100 * 2 and len(h.tensors) == 3201
    assert os.path.getsize(radixark / layout.INDEX) > 30_000_000  # the real one is 34 MB


@pytest.mark.parametrize("which", ["radixark", "nvidia"])
def test_verify_full_index_in_seconds(which, request):
    snap = request.getfixturevalue(which)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "flash_cli", "verify", "--path", str(snap), "--json"],
                         capture_output=True, text=True, cwd=ROOT, env=ENV)
    dt = time.monotonic() - t0
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)[0]
    assert r["index_keys"] in (296_475, 299_545) and r["ok"]
    assert dt < 45, f"verify took {dt:.1f} s"  # ~8–12 s on a 2-core CI box, ~3 s on a Spark


def test_hybrid_plan_both_layouts(radixark, nvidia):
    for snap in (radixark, nvidia):
        p = hybrid.plan(snap, hfcache.variant_dir(snap, "hybrid"))
        assert len(p.targets) == 312
        assert p.read_bytes == 2 * (2_909_798_400 + 12 * 640 * 2560)  # the 300 side layers + 12 indexer projections
    p = hybrid.plan(radixark, hfcache.variant_dir(radixark, "hybrid"))
    assert [f.name for f in p.files] == [f"model-bf16-000{n}.safetensors" for n in ("01", "10", "11", "12")]
    pn = hybrid.plan(nvidia, hfcache.variant_dir(nvidia, "hybrid"))
    assert all(f.name.startswith("model-000") for f in pn.files)
    for plan in (p, pn):  # the new shards are exactly the fp8 bytes smaller (+ scales + header delta)
        for f in plan.files:
            halved = sum(e.nbytes for e, s in f.entries if s[0] == "weight")
            scales = sum(e.nbytes for e, s in f.entries if s[0] == "scale")
            assert abs(f.source_size - f.new_size - (halved - scales)) < 200_000


def test_hybrid_full_scale_memory_time_and_second_run(radixark, cache):
    code = ("import json, resource, sys; from pathlib import Path; from flash_cli.checkpoint import hybrid; "
            "out = hybrid.prepare(Path(sys.argv[1])); "
            "print(json.dumps({'rss_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, **out['marker']}))")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code, str(radixark)], capture_output=True, text=True, env=ENV)
    dt = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["rss_kb"] * 1024 < 2 * 2**30, f"peak RSS {m['rss_kb'] / 1024:.0f} MiB"
    assert m["tensors"] == 312
    print(f"\nfull-scale hybrid: {dt:.1f} s, peak RSS {m['rss_kb'] / 1024:.0f} MiB")
    var = hfcache.variant_dir(radixark, "hybrid")
    assert verify.structure(var).ok
    # sparse (zero) data: every block takes the amax floor, codes are 0
    h = read_header(var / "model-bf16-00011.safetensors")
    name = next(k for k in h.tensors if k.endswith("in_proj_qkv.weight_scale"))
    t = h.tensors[name]
    assert t.shape == (80, 1, 20, 1)  # FP8_PB_WO: the [80, 20] grid as 4-D
    with open(var / "model-bf16-00011.safetensors", "rb") as f:
        f.seek(t.begin)
        s = np.frombuffer(f.read(t.nbytes), dtype=np.float32)
    assert np.all(s == np.float32(1e-12) / np.float32(448))
    env = dict(os.environ, HF_CACHE=str(cache), MODEL=ckpt.RADIXARK)
    t0 = time.monotonic()
    r2 = subprocess.run([str(ROOT / "scripts" / "prepare-hybrid.sh")], env=env, capture_output=True, text=True)
    second = time.monotonic() - t0
    assert r2.returncode == 0 and "already prepared" in r2.stderr, r2.stderr
    assert second < 10, f"second run took {second:.1f} s"


def test_graft_full_scale(radixark, cache):
    if hfcache.variant_state(radixark, "hybrid") != "ready":
        hybrid.prepare(radixark)
    rev = "e" * 40
    dsnap = ckpt.write_snapshot(cache, "donor", ckpt.REAL, sparse=True, revision=rev)
    path = dsnap / "nvfp4_experts_mtp.safetensors"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(64 << 20):
            h.update(chunk)
    donor = graft.Donor(revision=rev, sha256=h.hexdigest())
    s = resolve(overrides={"MODEL": ckpt.RADIXARK, "HF_CACHE": str(cache), "MODE": "hybrid-mtp"})
    out = graft.prepare(radixark, s, donor=donor)
    m = out["marker"]
    assert m["added_keys"] == 6144 and m["excludes"] == 37 and m["rewritten"] == ["model-bf16-00011.safetensors"]
    dest = hfcache.variant_dir(radixark, "hybrid-mtp")
    wm = json.loads((dest / layout.INDEX).read_text())["weight_map"]
    assert len(wm) == 296_475 + 312 - 2 + 6144
    before = os.path.getsize(hfcache.variant_dir(radixark, "hybrid") / "model-bf16-00011.safetensors")
    after = os.path.getsize(dest / "model-bf16-00011.safetensors")
    assert before - after > 5_000_000_000  # the 5.03 GB of fused BF16 experts are gone
    assert hfcache.variant_state(radixark, "hybrid-mtp") == "ready"


def test_shipped_draft_vocab_reproduces_from_its_recipe():
    corpus = Path(os.environ.get("FLASH_TEST_CACHE", Path.home() / ".cache" / "flash-tests")) / "draft-corpus"
    npy = ROOT / "src" / "flash_vllm" / "data" / "draft_vocab_65536.npy"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_draft_vocab.py"), "--check", str(npy),
                        "--corpus-dir", str(corpus)], capture_output=True, text=True)
    assert r.returncode == 0 and "reproduced bit for bit" in r.stdout, r.stdout + r.stderr
