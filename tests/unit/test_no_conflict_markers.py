"""No tracked file holds a merge's conflict markers: one slipped into both Dockerfiles in a merge
commit, and every check that reads only the line it needs (the patch-set stamp) stayed green."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# built from parts so this file does not match itself
MARKER = re.compile("^(" + "<" * 7 + " |" + "=" * 7 + "$|" + ">" * 7 + " )", re.M)


def test_no_tracked_file_has_conflict_markers():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    bad = []
    for name in filter(None, files):
        path = ROOT / name.decode()
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode("utf-8", "replace")
        bad += [f"{name.decode()}:{text.count(chr(10), 0, m.start()) + 1}" for m in MARKER.finditer(text)]
    assert not bad, f"conflict markers at {bad}"
