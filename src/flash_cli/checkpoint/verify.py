"""Is a snapshot (or a prepared variant) complete and well-formed? Optionally: are its bytes right?

Structural (seconds on ~300k index entries): essential files and a quant config exist, every
file the index names exists (a dangling link is missing), every header parses and its data
offsets fit the file, every index key is in the header of the file it maps to. `--hash`:
every blob's sha256 (LFS) or git-sha1 (small files) equals its name in the cache's blobs/.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .. import hfcache

_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")


@dataclass
class Result:
    directory: Path
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files: int = 0
    keys: int = 0
    tensors: int = 0
    hashed_bytes: int = 0
    headers: dict = field(default_factory=dict, repr=False)  # file name → Header

    @property
    def ok(self) -> bool:
        return not self.problems


def structure(directory: Path, index_required: bool = True, known_headers: dict | None = None) -> Result:
    """`known_headers`: file name → Header already read and validated from the very same file
    (the hybrid reads its linked shards' headers while it writes, not after)."""
    from flash_common.stheader import HeaderError, read_header, read_index

    directory = Path(directory)
    res = Result(directory)
    missing = set()
    for name in hfcache.missing_files(directory):
        if name.endswith("(unreadable)"):
            continue  # reported with its reason below
        res.problems.append(f"missing: {name}")
        missing.add(name)
    try:
        weight_map = read_index(directory)
    except HeaderError as exc:
        if index_required or (directory / hfcache.INDEX).exists():
            res.problems.append(f"index: {exc.problem}")
        return res
    res.keys = len(weight_map)
    from .known import table_problems

    res.problems += table_problems(weight_map)
    by_file: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
        by_file.setdefault(fname, []).append(key)
    for fname in sorted(by_file):
        if fname in missing:
            continue
        path = directory / fname
        header = (known_headers or {}).get(fname)
        if header is None:
            try:
                header = read_header(path)
            except HeaderError as exc:
                res.problems.append(f"{fname}: {exc.problem}")
                continue
        res.files += 1
        res.tensors += len(header.tensors)
        res.headers[fname] = header
        absent = [k for k in by_file[fname] if k not in header.tensors]
        if absent:
            res.problems.append(f"{fname}: {len(absent)} index key(s) not in its header, e.g. {absent[0]}")
        extra = len(header.tensors) - (len(by_file[fname]) - len(absent))
        if extra:
            res.warnings.append(f"{fname}: {extra} tensor(s) in the file are not in the index (vLLM loads whole files)")
    return res


def blob_name(path: Path) -> str | None:
    """The blobs/ file name a cache entry points to (its LFS sha256 or git sha1), if any."""
    if not path.is_symlink():
        return None
    real = Path(os.path.realpath(path))
    return real.name if real.parent.name == "blobs" else None


def _digest(path: Path, algo: str, size: int, bar) -> str:
    h = hashlib.sha256() if algo == "sha256" else hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(16 * 1024 * 1024)
            if not chunk:
                break
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return h.hexdigest()


def hashes(directory: Path, res: Result, progress: bool | None = None) -> None:
    """Compare each blob's content with its name; files that are not cache links are skipped."""
    directory = Path(directory)
    todo = []
    for p in sorted(directory.iterdir()):
        if p.name.startswith(".") or not p.is_file():
            continue
        name = blob_name(p)
        if name and (_SHA256.fullmatch(name) or _SHA1.fullmatch(name)):
            todo.append((p, name, p.stat().st_size))
    if not todo:
        res.warnings.append("--hash: no cache blobs to check (not an HF cache snapshot)")
        return
    total = sum(s for _, _, s in todo)
    bar = None
    if progress if progress is not None else sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="sha256", file=sys.stderr)
    try:
        for p, name, size in todo:
            algo = "sha256" if len(name) == 64 else "sha1"
            got = _digest(p, algo, size, bar)
            res.hashed_bytes += size
            if got != name:
                res.problems.append(f"{p.name}: content {algo} {got[:16]}… does not match the Hub's {name[:16]}… "
                                    "(corrupt: delete the blob and download again)")
    finally:
        if bar is not None:
            bar.close()


def verify(directory: Path, with_hash: bool = False, progress: bool | None = None) -> Result:
    res = structure(directory)
    if with_hash:
        hashes(directory, res, progress)
    return res
