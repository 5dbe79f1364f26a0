"""The tree a recorded result was taken at (benchmarks/PROVENANCE.md): what the gpu-e2e
tier's results.json and the decode matrix's raw rows name. Standard library only."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def tree_commit(root: Path, short: bool = False, unknown: str = "unknown") -> str:
    """FLASH_E2E_COMMIT when set (lab/gpu_session.sh sets it: the device's copy of the tree has
    no .git), else git's HEAD in `root`, else `unknown`."""
    if os.environ.get("FLASH_E2E_COMMIT"):
        return os.environ["FLASH_E2E_COMMIT"]
    argv = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        return subprocess.run(argv, cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return unknown
