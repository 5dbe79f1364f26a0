"""`flash download`: the checkpoint into the standard HF cache with huggingface_hub (+ hf_xet).

Plan first (`plan()`: one `repo_info` + one recursive tree listing; exact bytes per file, what
is cached, what is partly there as `blobs/<etag>.incomplete`, the disk check), then
`snapshot_download` pinned to the resolved commit (so `main` moving mid-download cannot mix
two revisions), then the structural verify.

Resuming: huggingface_hub 2.4 downloads into a per-process `<etag>.<random>.incomplete` file and
deletes it on failure (its PR #4228), so a killed download starts over. Over plain HTTP we
therefore fetch LFS files ourselves first: `blobs/<sha256>.incomplete` (a fixed name, resumed
with `Range: bytes=N-`), sha256-checked against the LFS pointer while it streams, renamed to
`blobs/<sha256>`; `snapshot_download` then finds the blobs and only links them and fetches the
small files. Files the Hub serves through Xet (XET=1 and a xet hash in the listing; the only way
for files over 50 GB) are left to hf_xet. What `main` resolved to is written to `refs/main`
(as huggingface_hub does) and recorded in `<repo>/flash-download.json`.

Interrupts and failures: the LFS files are fetched by daemon worker threads that check a stop
flag between chunks. Ctrl-C or the first failed file sets it: queued files are never started,
running ones stop at their next chunk (their `.incomplete` stays, resumable), and the command
returns within STOP_GRACE seconds instead of waiting for every queued download.

Integrity: a blob already in the cache with the right size is not trusted on its size: every
blob is hash-checked once (while it streams, or before the checkpoint counts as complete) and
recorded in `<repo>/flash-verified.json` (see verified.py).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import hfcache
from ..errors import ConfigError, FlashError, WeightsMissing
from ..output import say
from . import known, verified

DISK_MARGIN = 2 * 1024**3  # the cache also holds the tree listing, locks, refs
# Files that must never be excluded (serving needs them); shards are protected by suffix.
PROTECTED = set(hfcache.ESSENTIAL) | {hfcache.QUANT_FILE}


class DownloadError(FlashError):
    exit_code = 5


class _Stopped(Exception):
    """A worker noticed the stop flag at a chunk boundary (its partial file is kept)."""


STOP_GRACE = 0.5  # seconds the running fetches get to reach their next chunk after a stop


@dataclass
class FileInfo:
    path: str
    size: int
    etag: str  # LFS sha256 or git blob sha1: the blob's file name in the cache
    lfs: bool
    cached: bool
    partial: int  # bytes already in blobs/<etag>.incomplete
    xet: bool = False  # the Hub listed a xet hash for it


@dataclass
class Plan:
    model: str
    requested: str
    commit: str
    cache: Path
    files: list[FileInfo]
    excluded: list[str] = field(default_factory=list)
    bytes_free: int = 0

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def bytes_to_get(self) -> int:
        return sum(f.size - f.partial for f in self.files if not f.cached)

    def as_dict(self) -> dict:
        return {
            "model": self.model, "requested": self.requested, "commit": self.commit,
            "cache": str(self.cache), "files": len(self.files),
            "bytes_total": self.bytes_total, "bytes_to_get": self.bytes_to_get, "bytes_free": self.bytes_free,
            "excluded": self.excluded,
            "list": [{"path": f.path, "size": f.size, "sha256" if f.lfs else "git_sha1": f.etag,
                      "state": "cached" if f.cached else ("partial" if f.partial else "missing")} for f in self.files],
        }


def token_for(hf_cache: str | Path, env=None) -> str | None:
    """HF_TOKEN, else HUGGING_FACE_HUB_TOKEN, else `<HF_CACHE>/token` (`hf auth login` there),
    else huggingface_hub's own lookup. Never printed, never in argv."""
    env = os.environ if env is None else env
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if env.get(var):
            return env[var].strip()
    f = hfcache.cache_root(hf_cache) / "token"
    try:
        text = f.read_text().strip()
        if text:
            return text
    except OSError:
        pass
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # noqa: BLE001 - no token is a normal state
        return None


def exclude_patterns(settings) -> list[str]:
    raw = settings["EXCLUDE"] or ""
    pats = raw.split()
    for pat in pats:
        hit = [name for name in sorted(PROTECTED) if fnmatch.fnmatch(name, pat)]
        if hit or fnmatch.fnmatch("x.safetensors", pat) or fnmatch.fnmatch("model-00001-of-00010.safetensors", pat) \
                or pat.endswith(".safetensors"):
            raise ConfigError(f"EXCLUDE={raw!r}: {pat!r} would skip files serving needs"
                              + (f" ({', '.join(hit)})" if hit else " (weight shards)"),
                              hint="exclude only extras, e.g. EXCLUDE='*.complete.json qualification-notes.md'")
    return pats


def _xet_env(enabled: bool) -> None:
    """huggingface_hub reads HF_HUB_DISABLE_XET at import: set both the env and the constant."""
    os.environ["HF_HUB_DISABLE_XET"] = "0" if enabled else "1"
    if enabled:
        os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")
    try:
        from huggingface_hub import constants

        constants.HF_HUB_DISABLE_XET = not enabled
    except (ImportError, AttributeError):
        pass


def _online() -> None:
    """An explicit `flash download` is online by definition, whatever HF_HUB_OFFLINE says."""
    os.environ["HF_HUB_OFFLINE"] = "0"
    try:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = False
    except (ImportError, AttributeError):
        pass


def plan(settings, env=None) -> Plan:
    _online()
    _xet_env(settings["XET"])
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.hf_api import RepoFile

    env = os.environ if env is None else env
    model, requested = settings["MODEL"], settings["REVISION"] or "main"
    cache = hfcache.cache_root(settings["HF_CACHE"])
    api = HfApi(endpoint=env.get("HF_ENDPOINT") or None, token=token_for(cache, env) or False)
    excl = exclude_patterns(settings)
    try:
        info = api.repo_info(model, revision=requested)
        commit = info.sha
        entries = [f for f in api.list_repo_tree(model, recursive=True, revision=commit) if isinstance(f, RepoFile)]
    except RevisionNotFoundError:
        raise ConfigError(f"REVISION={requested!r} does not exist in {model}",
                          hint="use a commit sha or a branch name the repo has (empty = main)") from None
    except RepositoryNotFoundError:
        raise DownloadError(f"{model} is not on the Hub or needs a token you do not have",
                            hint="check MODEL; for gated repos set HF_TOKEN or run `hf auth login`") from None
    except HfHubHTTPError as exc:
        raise DownloadError(f"the Hub refused the file listing of {model}: {exc}".splitlines()[0],
                            hint="retry; check HF_TOKEN for gated repos") from None
    except Exception as exc:  # noqa: BLE001 - network errors of several libraries
        raise DownloadError(f"cannot reach the Hub for {model}: {type(exc).__name__}: {exc}".splitlines()[0],
                            hint="check the network (HF_ENDPOINT for a mirror); a cached snapshot still serves offline") from None
    repo = hfcache.repo_dir(cache, model)
    files, excluded = [], []
    layout = known.for_model(model)  # a known layout fetches its serving files only (known.SERVING_FILES)
    for f in sorted(entries, key=lambda e: e.path):
        if any(fnmatch.fnmatch(f.path, p) for p in excl) or not known.allowed(f.path, layout):
            excluded.append(f.path)
            continue
        lfs = f.lfs is not None
        size = f.lfs.size if lfs else f.size
        etag = f.lfs.sha256 if lfs else f.blob_id
        blob = repo / "blobs" / etag
        link = repo / "snapshots" / commit / f.path
        cached = blob.is_file() and blob.stat().st_size == size and link.exists()
        inc = blob.with_name(etag + ".incomplete")
        partial = inc.stat().st_size if (not cached and inc.is_file()) else 0
        files.append(FileInfo(f.path, size, etag, lfs, cached, min(partial, size), xet=bool(f.xet_hash)))
    p = Plan(model, requested, commit, cache, files, excluded)
    probe = cache
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    p.bytes_free = shutil.disk_usage(probe).free
    return p


def _fetch_lfs(url: str, f: FileInfo, blobs: Path, token: str | None, bar=None, stop=None) -> None:
    """One LFS file into blobs/<sha256>, resuming blobs/<sha256>.incomplete; sha256-checked."""
    from filelock import FileLock

    blob = blobs / f.etag
    # huggingface_hub's own lock for this blob: a parallel `hf download` waits instead of racing
    lock = blobs.parent.parent / ".locks" / blobs.parent.name / f"{f.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    if stop is not None and stop.is_set():
        raise _Stopped()
    with FileLock(str(lock)):
        _fetch_locked(url, f, blob, token, bar, stop)


def _fetch_locked(url: str, f: FileInfo, blob: Path, token: str | None, bar, stop=None) -> None:
    import hashlib

    import requests

    if blob.is_file() and blob.stat().st_size == f.size:
        if verified.check(blob):  # hashed once (now, or by an earlier run): the size alone proves nothing
            return
        say(f"  ! {f.path}: the cached blob has the right size but not the right content; downloading it again")
        blob.unlink()
    part = blob.with_name(f.etag + ".incomplete")
    h = hashlib.sha256()
    have = part.stat().st_size if part.is_file() else 0
    if have > f.size:
        part.unlink()
        have = 0
    if have:
        with open(part, "rb") as src:  # the hash covers the whole file, so re-read what is there
            while chunk := src.read(16 << 20):
                h.update(chunk)
        if bar is not None:
            bar.update(have)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if have < f.size:
        if have:
            headers["Range"] = f"bytes={have}-"
        # requests drops Authorization on a redirect to another host (the CDN), as it should
        with requests.get(url, headers=headers, stream=True, timeout=(10, 60), allow_redirects=True) as r:
            if r.status_code == 200 and have:  # the server ignored the range: start over
                have = 0
                h = hashlib.sha256()
                mode = "wb"
            elif r.status_code in (200, 206):
                mode = "ab" if have else "wb"
            else:
                raise DownloadError(f"{f.path}: HTTP {r.status_code} from the Hub",
                                    hint="a 401/403 needs HF_TOKEN; run again to resume")
            with open(part, mode) as out:
                for chunk in r.iter_content(chunk_size=1 << 20):
                    if stop is not None and stop.is_set():
                        raise _Stopped()  # what was written stays in .incomplete: resumable
                    out.write(chunk)
                    h.update(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
    size = part.stat().st_size
    if size != f.size:
        raise DownloadError(f"{f.path}: got {size} of {f.size} bytes", hint="run again: it resumes")
    if h.hexdigest() != f.etag:
        part.unlink()
        raise DownloadError(f"{f.path}: sha256 {h.hexdigest()} does not match the Hub's {f.etag}; discarded",
                            hint="run again to download it fresh")
    os.chmod(part, 0o644)
    os.replace(part, blob)
    verified.record(blob)  # hashed while it streamed


def fetch_resumable(p: Plan, settings, env=None, progress: bool = False) -> None:
    """Our resumable, hash-checked HTTP path for the LFS files hf_xet will not handle."""
    from huggingface_hub import hf_hub_url

    env = os.environ if env is None else env
    todo = [f for f in p.files if f.lfs and not f.cached and not (settings["XET"] and f.xet)]
    if not todo:
        return
    blobs = hfcache.repo_dir(p.cache, p.model) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for stale in blobs.glob("*.*.incomplete"):  # huggingface_hub's per-process temp files: never reused
        stale.unlink(missing_ok=True)
    token = token_for(p.cache, env)
    endpoint = env.get("HF_ENDPOINT") or None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(f.size for f in todo), unit="B", unit_scale=True, unit_divisor=1024,
                   desc="download", file=sys.stderr)
    jobs = [(hf_hub_url(p.model, f.path, revision=p.commit, endpoint=endpoint), f) for f in todo]
    try:
        run_stoppable(lambda job, stop: _fetch_lfs(job[0], job[1], blobs, token, bar, stop), jobs,
                      settings["MAX_WORKERS"])
    finally:
        if bar is not None:
            bar.close()


def run_stoppable(fn, jobs: list, workers: int, grace: float = STOP_GRACE) -> None:
    """Run `fn(job, stop)` over `jobs` on `workers` daemon threads, in order.

    The first failure or a KeyboardInterrupt in the caller sets `stop`: no queued job starts,
    running ones stop where they next check it (`_Stopped`), and this returns (raising the
    first failure, or the interrupt) after at most `grace` seconds. Daemon threads: a fetch
    stuck in a socket read cannot hold the process's exit.
    """
    import queue
    import threading

    q: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        q.put(job)
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker() -> None:
        while not stop.is_set():
            try:
                job = q.get_nowait()
            except queue.Empty:
                return
            try:
                fn(job, stop)
            except _Stopped:
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                errors.append(exc)
                stop.set()
                return

    threads = [threading.Thread(target=worker, daemon=True, name=f"flash-fetch-{i}")
               for i in range(max(1, min(workers, len(jobs))))]
    for t in threads:
        t.start()
    stopped_at = None
    try:
        while any(t.is_alive() for t in threads):
            if stop.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > grace:
                    break
            for t in threads:
                t.join(0.05)
    except BaseException:  # KeyboardInterrupt (SIGINT lands in this thread) or SystemExit
        stop.set()
        deadline = time.monotonic() + grace
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        raise
    if errors:
        raise errors[0]


def execute(p: Plan, settings, env=None, progress: bool | None = None) -> Path:
    env = os.environ if env is None else env
    need = p.bytes_to_get
    if need and need + DISK_MARGIN > p.bytes_free:
        raise DownloadError(f"not enough disk for {p.model}: {need / 1e9:.2f} GB still to download "
                            f"(+{DISK_MARGIN / 1e9:.0f} GB margin), {p.bytes_free / 1e9:.2f} GB free under {p.cache}",
                            hint="free space there or point HF_CACHE at a bigger disk")
    _online()
    _xet_env(settings["XET"])
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    tty = sys.stderr.isatty() if progress is None else progress
    (enable_progress_bars if tty else disable_progress_bars)()
    kwargs = dict(repo_id=p.model, revision=p.commit, cache_dir=str(p.cache / "hub"),
                  ignore_patterns=p.excluded or None, max_workers=settings["MAX_WORKERS"],
                  endpoint=env.get("HF_ENDPOINT") or None, token=token_for(p.cache, env) or False)
    if p.excluded:  # the EXCLUDE globs, plus each file a known layout does not serve from (by path)
        globs = exclude_patterns(settings)
        kwargs["ignore_patterns"] = globs + [x for x in p.excluded if not any(fnmatch.fnmatch(x, g) for g in globs)]
    say(f"  downloading {p.model}@{p.commit[:12]}: {len([f for f in p.files if not f.cached])} files, "
        f"{p.bytes_to_get / 1e9:.2f} GB to get ({'Xet' if settings['XET'] else 'HTTPS'}, {settings['MAX_WORKERS']} workers)")
    attempts = 0
    while True:
        attempts += 1
        try:
            fetch_resumable(p, settings, env, progress=tty)
            snapshot = Path(snapshot_download(**kwargs))
            # before it counts as complete: hash what no run of ours has hashed (cached blobs,
            # Xet's and snapshot_download's); a corrupt one is removed and fetched again
            bad = verified.check_snapshot(snapshot)
            if bad:
                raise DownloadError(bad[0], hint="run flash download again: it fetches the removed blobs")
            break
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - re-check: Xet can fail after every blob landed
            left = plan(settings, env).bytes_to_get
            if left == 0:
                say(f"  ! the download ended with {type(exc).__name__}, but every file is complete")
                snapshot = hfcache.repo_dir(p.cache, p.model) / "snapshots" / p.commit
                break
            if attempts >= 2:
                raise DownloadError(f"download of {p.model} failed: {type(exc).__name__}: {exc}".splitlines()[0],
                                    hint="run it again: it resumes from the .incomplete blobs") from None
            say(f"  ! {type(exc).__name__}; {left / 1e9:.2f} GB left, retrying once (resumes)")
    repo = hfcache.repo_dir(p.cache, p.model)
    if p.requested != p.commit:
        ref = repo / "refs" / p.requested
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(ref.name + ".tmp")
        tmp.write_text(p.commit)
        os.replace(tmp, ref)
    record = {"model": p.model, "requested": p.requested, "resolved": p.commit,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": len(p.files),
              "bytes": p.bytes_total, "excluded": p.excluded}
    tmp = repo / "flash-download.json.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, repo / "flash-download.json")
    return snapshot


# --- flash setup interface ------------------------------------------------------------------

def is_done(settings) -> bool:
    """Local only (setup must not need the network to see that nothing is to do)."""
    snap = hfcache.resolve_snapshot(settings["HF_CACHE"], settings["MODEL"], settings["REVISION"])
    return snap is not None and not hfcache.missing_files(snap) and not verified.unverified(snap)


def run_step(settings, dry_run: bool) -> dict:
    from . import verify

    snap = hfcache.resolve_snapshot(settings["HF_CACHE"], settings["MODEL"], settings["REVISION"])
    if not dry_run and snap is not None and not hfcache.missing_files(snap):
        # complete on disk but not every blob hashed yet (fetched by another tool, or before
        # flash-verified.json existed): hash them here, no network needed unless one is corrupt
        bad = verified.check_snapshot(snap)
        if not bad:
            say(f"  ✔ {snap}: every blob hash-verified")
            return {"action": "verified", "snapshot": str(snap)}
        for line in bad:
            say(f"  ! {line}")
    p = plan(settings)
    if dry_run:
        say(f"  would download {p.model}@{p.commit[:12]}: {p.bytes_to_get / 1e9:.2f} GB of {p.bytes_total / 1e9:.2f} GB")
        return {"action": "plan", "plan": p.as_dict()}
    snap = execute(p, settings)
    res = verify.structure(snap)
    if not res.ok:
        raise WeightsMissing(f"{snap} is not complete after the download: {res.problems[0]}",
                             hint="run flash download again (it resumes); flash verify lists every problem")
    say(f"  ✔ {p.model}@{p.commit[:12]} complete: {res.keys} index keys in {res.files} files")
    return {"action": "downloaded", "snapshot": str(snap)}
