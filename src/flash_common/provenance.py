"""The tree a recorded result was taken at (benchmarks/PROVENANCE.md): what the gpu-e2e
tier's results.json and the decode matrix's raw rows name. Standard library only."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def tree_commit(root: Path, short: bool = False, unknown: str = "unknown") -> str:
    """FLASH_E2E_COMMIT when set (lab/gpu_session.sh sets it), else git's HEAD in `root` with
    `+dirty` when the files differ from it, else `unknown`.

    The `+dirty` matters on the device: its copy of the tree carries a .git whose HEAD is the last
    landed commit, with the session's own commits as uncommitted changes on top (2026-12-05: a
    direct `tests/run gpu-e2e` stamped 05fa735 while running 61d2640's files)."""
    if os.environ.get("FLASH_E2E_COMMIT"):
        return os.environ["FLASH_E2E_COMMIT"]
    argv = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        head = subprocess.run(argv, cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True,
                                 check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return unknown
    return f"{head}+dirty" if changed else head
