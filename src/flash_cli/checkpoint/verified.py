"""Which cache blobs were hash-verified: `<repo>/flash-verified.json`.

A blob's file name is its content hash (LFS sha256, or the git blob sha1 of a small file), so a
blob of the right size can still be corrupt (a bad disk, a copy cut and padded, an earlier tool
that never hashed). `flash download` hashes every blob it fetches while it streams and records
it here; a blob found already in the cache is hashed once before the checkpoint counts as
complete. An entry holds the blob's size and mtime: a blob rewritten since is hashed again.
`flash verify --hash` stays the explicit full check (it ignores this file).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from pathlib import Path

STATE = "flash-verified.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")
_lock = threading.Lock()  # one writer per process (download workers record concurrently)


def _state_path(blob: Path) -> Path:
    return Path(blob).parent.parent / STATE  # <repo>/blobs/<name> → <repo>/flash-verified.json


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    blobs = data.get("blobs") if isinstance(data, dict) else None
    return blobs if isinstance(blobs, dict) else {}


def _stamp(blob: Path) -> list[int]:
    st = os.stat(blob)
    return [st.st_size, st.st_mtime_ns]


def is_verified(blob: Path) -> bool:
    try:
        return _load(_state_path(blob)).get(Path(blob).name) == _stamp(blob)
    except OSError:
        return False


def record(blob: Path) -> None:
    """Mark `blob` (whose content was just hashed and matched its name) as verified."""
    blob = Path(blob)
    path = _state_path(blob)
    with _lock:
        blobs = _load(path)
        blobs[blob.name] = _stamp(blob)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{STATE}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"blobs": blobs}, fh, indent=0, sort_keys=True)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def digest(blob: Path, name: str | None = None, stop: threading.Event | None = None) -> str:
    """The blob's content hash in the scheme its name uses (sha256 for 64 hex digits, else the
    git blob sha1)."""
    name = name or Path(blob).name
    size = os.path.getsize(blob)
    h = hashlib.sha256() if _SHA256.fullmatch(name) else hashlib.sha1(b"blob %d\0" % size)
    with open(blob, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            if stop is not None and stop.is_set():
                raise InterruptedError(f"hashing {blob} cancelled")
            h.update(chunk)
    return h.hexdigest()


def check(blob: Path) -> bool:
    """True when the blob is recorded as verified or its content matches its name now (then it is
    recorded). False: corrupt (the caller removes it)."""
    blob = Path(blob)
    if is_verified(blob):
        return True
    if digest(blob) != blob.name:
        return False
    record(blob)
    return True


def snapshot_blobs(snapshot: Path) -> list[tuple[str, Path]]:
    """(file name in the snapshot, blob path) for every entry that links to a content-named blob."""
    out = []
    for p in sorted(Path(snapshot).rglob("*")):
        if not p.is_symlink() or p.name.startswith("."):
            continue
        real = Path(os.path.realpath(p))
        if real.parent.name == "blobs" and (_SHA256.fullmatch(real.name) or _SHA1.fullmatch(real.name)):
            out.append((str(p.relative_to(snapshot)), real))
    return out


def unverified(snapshot: Path) -> list[tuple[str, Path]]:
    """Cheap (stat only): the snapshot's blobs not recorded as verified in their current state."""
    return [(n, b) for n, b in snapshot_blobs(snapshot) if b.is_file() and not is_verified(b)]


def check_snapshot(snapshot: Path) -> list[str]:
    """Hash every unverified blob of `snapshot`; corrupt ones are removed (their links then
    dangle, so the snapshot reads as incomplete and a download fetches them again). Returns one
    line per corrupt file."""
    bad = []
    for name, blob in unverified(snapshot):
        if not check(blob):
            blob.unlink(missing_ok=True)
            bad.append(f"{name}: blob {blob.name[:16]}… has the right size but its content does not match its "
                       "hash (corrupt); removed")
    return bad
