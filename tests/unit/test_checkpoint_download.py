"""flash download against a local Hub endpoint that real huggingface_hub talks to (real HTTP)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes import ckpt
from fakes.hub import FakeHub
from flash_cli import hfcache
from flash_cli.checkpoint import download, verify
from flash_cli.errors import ConfigError
from flash_cli.settings import resolve

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "c0ffee" + "0" * 34
BIG = "model-bf16-00012.safetensors"  # embed + lm_head: 33 MB with this vocab
DIMS = ckpt.Dims(**{**ckpt.TINY.__dict__, "vocab": 32768})


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    return ckpt.write_snapshot(tmp_path_factory.mktemp("origin"), "radixark", DIMS)


@pytest.fixture
def hub(origin, monkeypatch):
    src = origin
    h = FakeHub()
    h.add_dir(ckpt.RADIXARK, src, COMMIT)
    h.start()
    monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)  # restored after the test
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", constants.HF_HUB_DISABLE_XET)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield h, src
    h.stop()


def _settings(cache, **kw):
    return resolve(overrides={"MODEL": ckpt.RADIXARK, "HF_CACHE": str(cache), **kw})


def test_dry_run_plan_exact_bytes_then_download_verifies(hub, tmp_path):
    h, src = hub
    cache = tmp_path / "cache"
    s = _settings(cache)
    p = download.plan(s)
    sizes = {f.name: f.stat().st_size for f in src.iterdir()}
    assert p.commit == COMMIT and {f.path: f.size for f in p.files} == sizes
    assert p.bytes_to_get == sum(sizes.values()) and not cache.exists()  # the plan writes nothing
    snap = download.execute(p, s, progress=False)
    assert snap == hfcache.repo_dir(cache, ckpt.RADIXARK) / "snapshots" / COMMIT
    res = verify.verify(snap, with_hash=True, progress=False)
    assert res.ok and res.hashed_bytes == sum(sizes.values())
    repo = hfcache.repo_dir(cache, ckpt.RADIXARK)
    assert (repo / "refs" / "main").read_text() == COMMIT
    assert json.loads((repo / "flash-download.json").read_text())["resolved"] == COMMIT
    assert download.is_done(s) and download.plan(s).bytes_to_get == 0
    # the blobs carry the Hub's names: LFS sha256 for shards
    assert os.path.basename(os.path.realpath(snap / BIG)) == next(f.etag for f in p.files if f.path == BIG)


def test_dropped_connection_resumes_with_a_range_request(hub, tmp_path, monkeypatch):
    h, src = hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)  # count bytes before the drop
    h.drop_after[BIG] = 3_000_000
    s = _settings(tmp_path / "cache")
    snap = download.execute(download.plan(s), s, progress=False)
    assert verify.verify(snap, with_hash=True, progress=False).ok
    ranges = [hd.get("Range") or hd.get("range") for m, path, hd in h.requests if path.startswith("/lfs/")]
    assert any(r and r.startswith("bytes=") and int(r[6:-1]) > 0 for r in ranges), ranges


def test_killed_download_resumes_from_incomplete_blob(hub, tmp_path):
    h, src = hub
    h.throttle_bps = 8_000_000  # the 33 MB shard takes ~4 s
    sha = h.repos[ckpt.RADIXARK].commits[COMMIT][BIG].sha256
    cache = tmp_path / "cache"
    part = hfcache.repo_dir(cache, ckpt.RADIXARK) / "blobs" / (sha + ".incomplete")
    env = dict(os.environ, HF_ENDPOINT=h.endpoint, HF_HUB_OFFLINE="0", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "flash_cli", "download", "--no-profile", f"MODEL={ckpt.RADIXARK}",
                             f"HF_CACHE={cache}", "MAX_WORKERS=8"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (part.is_file() and part.stat().st_size > 2_000_000):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    s = _settings(cache)
    p = download.plan(s)
    big = next(f for f in p.files if f.path == BIG)
    assert not big.cached and 2_000_000 < big.partial < big.size, "the kill did not land mid-file"
    assert p.bytes_to_get == sum(f.size - f.partial for f in p.files if not f.cached) < p.bytes_total
    assert not download.is_done(s)
    h.throttle_bps = None
    n_before = len(h.requests)
    snap = download.execute(p, s, progress=False)
    assert verify.verify(snap, with_hash=True, progress=False).ok
    resumed = [hd.get("Range") for m, path, hd in h.requests[n_before:] if path == f"/lfs/{sha}"]
    assert resumed == [f"bytes={big.partial}-"]


def test_revision_pin_and_what_main_resolved_to(hub, tmp_path):
    h, src = hub
    newer = "beef" + "1" * 36
    (tmp_path / "v2").mkdir()
    for f in src.iterdir():
        os.symlink(os.path.realpath(f), tmp_path / "v2" / f.name)
    (tmp_path / "v2" / "README.md").write_text("v2\n")
    h.add_dir(ckpt.RADIXARK, tmp_path / "v2", newer)  # main moves on
    cache = tmp_path / "cache"
    pinned = download.plan(_settings(cache, REVISION=COMMIT))
    assert pinned.commit == COMMIT and "README.md" not in {f.path for f in pinned.files}
    p = download.plan(_settings(cache))
    assert p.commit == newer and p.requested == "main"
    with pytest.raises(ConfigError, match="REVISION='nope'"):
        download.plan(_settings(cache, REVISION="nope"))


def test_exclude_globs_and_protected_files(hub, tmp_path):
    cache = tmp_path / "cache"
    s = _settings(cache, EXCLUDE="*.complete.json qualification-notes.md")
    p = download.plan(s)
    assert p.excluded and all(x.endswith(".complete.json") or x == "qualification-notes.md" for x in p.excluded)
    snap = download.execute(p, s, progress=False)
    assert not list(snap.glob("*.complete.json")) and verify.structure(snap).ok
    for bad in ("*.safetensors", "layer-00000-*.safetensors", "*.json", "*"):
        with pytest.raises(ConfigError, match="serving needs"):
            download.plan(_settings(cache, EXCLUDE=bad))


def test_token_from_env_or_cache_file(hub, tmp_path, monkeypatch):
    h, src = hub
    h.repos[ckpt.RADIXARK].token = "hf_secret"
    cache = tmp_path / "cache"
    with pytest.raises(download.DownloadError, match="token"):
        download.plan(_settings(cache))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert download.plan(_settings(cache)).commit == COMMIT
    monkeypatch.delenv("HF_TOKEN")
    cache.mkdir()
    (cache / "token").write_text("hf_secret\n")
    assert download.plan(_settings(cache)).commit == COMMIT


def test_disk_preflight_uses_exact_bytes(hub, tmp_path, monkeypatch):
    import shutil

    real = shutil.disk_usage
    s = _settings(tmp_path / "cache")
    p = download.plan(s)
    p.bytes_free = p.bytes_to_get + download.DISK_MARGIN - 1
    with pytest.raises(download.DownloadError, match="not enough disk"):
        download.execute(p, s, progress=False)
    assert not (tmp_path / "cache").exists()
    assert real  # (the real disk_usage is what plan() used)


def test_corrupt_transfer_is_refused_and_corrupt_blob_caught_by_verify_hash(hub, tmp_path):
    h, src = hub
    h.corrupt[BIG] = True  # same size, valid header: only a hash can tell
    s = _settings(tmp_path / "cache")
    with pytest.raises(download.DownloadError, match="does not match the Hub"):
        download.execute(download.plan(s), s, progress=False)
    assert not download.is_done(s)
    h.corrupt.clear()
    snap = download.execute(download.plan(s), s, progress=False)
    assert verify.verify(snap, with_hash=True, progress=False).ok
    # a blob corrupted on disk later (the field's size-correct broken shards)
    blob = os.path.realpath(snap / BIG)
    with open(blob, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert verify.structure(snap).ok
    res = verify.verify(snap, with_hash=True, progress=False)
    assert not res.ok and BIG in res.problems[0] and "does not match" in res.problems[0]


def test_cli_dry_run_json_and_xet_switch(hub, tmp_path):
    h, src = hub
    env = dict(os.environ, HF_ENDPOINT=h.endpoint, HF_HUB_OFFLINE="0", PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, "-m", "flash_cli", "download", "--no-profile", f"MODEL={ckpt.RADIXARK}",
                          f"HF_CACHE={tmp_path / 'c'}", "XET=0", "--dry-run", "--json"],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["commit"] == COMMIT and plan["bytes_to_get"] == plan["bytes_total"] > 0
    assert all(e["state"] == "missing" for e in plan["list"])
    download._xet_env(False)
    assert os.environ["HF_HUB_DISABLE_XET"] == "1"
    download._xet_env(True)
    assert os.environ["HF_HUB_DISABLE_XET"] == "0" and os.environ["HF_XET_HIGH_PERFORMANCE"] == "1"
