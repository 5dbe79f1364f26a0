"""One file's sha256, read in 16 MiB chunks (checkpoint shards are GBs). Standard library only.
(`hashlib.file_digest` would do, but it is Python 3.11+ and the project supports 3.10.)"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

CHUNK = 16 << 20


def sha256_file(path: Path, on_chunk: Callable[[int], object] | None = None) -> str:
    """Hex sha256 of `path`; `on_chunk(n)` after each chunk read (a progress bar's update)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return h.hexdigest()
