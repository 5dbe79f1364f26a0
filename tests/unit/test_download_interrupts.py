"""`flash download` under Ctrl-C and partial failure, against the fake Hub over real HTTP (issue
14): queued files are never started, running fetches stop at their next chunk, partials stay
resumable, SIGINT exits 130 within a second, the first failed file ends the run at once. And a
corrupt blob of the right size is caught before the checkpoint counts as complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fakes import ckpt
from flash_cli import hfcache
from flash_cli.checkpoint import download, verified, verify

from test_checkpoint_download import BIG, COMMIT, ROOT, _settings, hub, origin  # noqa: F401 - fixtures

FIRST = "model-bf16-00001.safetensors"  # 3.9 MB: ~2 s at the throttled rate, started early


def _lfs_paths(h, sha_to_path):
    return [sha_to_path.get(path.rsplit("/", 1)[1]) for m, path, hd in h.requests if path.startswith("/lfs/")]


def test_sigint_stops_queued_and_running_fetches_within_a_second(hub, tmp_path):
    h, src = hub
    h.throttle_bps = 2_000_000
    files = h.repos[ckpt.RADIXARK].commits[COMMIT]
    sha_to_path = {f.sha256: f.path for f in files.values() if f.lfs}
    cache = tmp_path / "cache"
    blobs = hfcache.repo_dir(cache, ckpt.RADIXARK) / "blobs"
    part = blobs / (files[FIRST].sha256 + ".incomplete")
    env = dict(os.environ, HF_ENDPOINT=h.endpoint, HF_HUB_OFFLINE="0", PYTHONPATH=str(ROOT / "src"))
    # A shell without job control starts background commands with SIGINT ignored, and an ignored
    # signal stays ignored across exec: Python would then never raise KeyboardInterrupt in the child
    # (pytest launched as `... &` failed here every time). A handled signal resets to the default
    # at exec, so give the child a SIGINT as a terminal's Ctrl-C would deliver it.
    inherited = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "flash_cli", "download", "--no-profile",
                                 f"MODEL={ckpt.RADIXARK}", f"HF_CACHE={cache}", "MAX_WORKERS=2"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not (part.is_file() and part.stat().st_size > 300_000):
        time.sleep(0.02)
    if not part.is_file() or proc.poll() is not None:
        proc.kill()
        pytest.fail(f"the download never reached the first big shard (exit {proc.wait()}): {proc.stderr.read()[-2000:]}")
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        rc = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"SIGINT did not stop flash download within 15 s: {proc.stderr.read()[-3000:]}")
    elapsed = time.monotonic() - sent
    err = proc.stderr.read()
    assert rc == 130 and "interrupted" in err, (rc, err[-2000:])
    assert elapsed < 1.0, f"SIGINT surfaced after {elapsed:.2f} s"
    # queued work never started: the last (biggest) shard was never requested, and no more files
    # than workers were left partial
    requested = _lfs_paths(h, sha_to_path)
    assert BIG not in requested, requested
    assert 1 <= len(list(blobs.glob("*.incomplete"))) <= 2
    # the running fetch stopped mid-file and its partial is kept: the next run resumes it
    kept = part.stat().st_size
    assert 300_000 <= kept < files[FIRST].size
    time.sleep(0.5)
    assert part.stat().st_size == kept, "a fetch kept writing after the process was gone"
    h.throttle_bps = None
    s = _settings(cache)
    p = download.plan(s)
    assert next(f for f in p.files if f.path == FIRST).partial == kept
    n = len(h.requests)
    snap = download.execute(p, s, progress=False)
    assert verify.verify(snap, with_hash=True, progress=False).ok
    assert [hd.get("Range") for m, path, hd in h.requests[n:] if path == f"/lfs/{files[FIRST].sha256}"] == [f"bytes={kept}-"]


def test_first_failed_file_cancels_the_rest_at_once(hub, tmp_path):
    h, src = hub
    h.throttle_bps = 2_000_000
    files = h.repos[ckpt.RADIXARK].commits[COMMIT]
    sha_to_path = {f.sha256: f.path for f in files.values() if f.lfs}
    h.fail_status["model-bf16-00010.safetensors"] = 500
    s = _settings(tmp_path / "cache", MAX_WORKERS="2")  # 2 running, the rest queued behind them
    p = download.plan(s)
    t0 = time.monotonic()
    with pytest.raises(download.DownloadError, match="model-bf16-00010.safetensors: HTTP 500"):
        download.fetch_resumable(p, s)
    elapsed = time.monotonic() - t0
    requested = _lfs_paths(h, sha_to_path)
    assert BIG not in requested and "model-bf16-00011.safetensors" not in requested, requested
    assert elapsed < 4.0, f"the failure surfaced after {elapsed:.1f} s (queued downloads were waited for)"
    part = hfcache.repo_dir(p.cache, p.model) / "blobs" / (files[FIRST].sha256 + ".incomplete")
    assert part.is_file() and part.stat().st_size < files[FIRST].size  # stopped at a chunk boundary, kept


def test_run_stoppable_raises_the_first_failure_and_starts_nothing_after_it():
    started = []

    def job(i, stop):
        started.append(i)
        if i == 1:
            raise ValueError("file 1 broke")
        while not stop.is_set():  # a long fetch that checks the flag between chunks
            time.sleep(0.01)
        raise download._Stopped()

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="file 1 broke"):
        download.run_stoppable(job, list(range(50)), workers=2)
    assert time.monotonic() - t0 < 1.0 and sorted(started) == [0, 1]


def test_corrupt_cached_blob_of_the_right_size_is_caught_before_complete(hub, tmp_path):
    h, src = hub
    s = _settings(tmp_path / "cache")
    snap = download.execute(download.plan(s), s, progress=False)
    repo = hfcache.repo_dir(tmp_path / "cache", ckpt.RADIXARK)
    state = json.loads((repo / verified.STATE).read_text())["blobs"]
    assert len(state) == len(verified.snapshot_blobs(snap))  # every blob recorded as hash-verified
    blob = os.path.realpath(snap / BIG)
    with open(blob, "r+b") as f:  # same size, flipped byte: what the field's broken shards looked like
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert not download.is_done(s)  # rewritten since it was verified: no longer trusted
    assert verify.structure(snap).ok  # the structure alone cannot see it
    n = len(h.requests)
    snap = download.execute(download.plan(s), s, progress=False)  # re-hashes, replaces the blob
    assert verify.verify(snap, with_hash=True, progress=False).ok and download.is_done(s)
    assert any(path == f"/lfs/{h.repos[ckpt.RADIXARK].commits[COMMIT][BIG].sha256}" for m, path, hd in h.requests[n:])


def test_setup_hashes_an_unrecorded_complete_snapshot_offline(hub, tmp_path):
    h, src = hub
    s = _settings(tmp_path / "cache")
    snap = download.execute(download.plan(s), s, progress=False)
    repo = hfcache.repo_dir(tmp_path / "cache", ckpt.RADIXARK)
    (repo / verified.STATE).unlink()  # as if another tool (or an older flash) had downloaded it
    assert not download.is_done(s)
    h.stop()  # offline: hashing what is on disk needs no network
    assert download.run_step(s, dry_run=False)["action"] == "verified"
    assert download.is_done(s)
