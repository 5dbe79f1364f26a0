"""flash_common.provenance.tree_commit on real git repositories: HEAD, `+dirty` when the files
differ from it (the device's copy: a stale .git under newer files), FLASH_E2E_COMMIT first."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from flash_common.provenance import tree_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git (Debian's git package)")


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_head_then_dirty_then_the_override(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASH_E2E_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert tree_commit(tmp_path) == head
    assert tree_commit(tmp_path, short=True) == head[:len(tree_commit(tmp_path, short=True))]
    (tmp_path / "a.py").write_text("x = 2\n")  # a later commit's files under the old .git
    assert tree_commit(tmp_path) == f"{head}+dirty"
    monkeypatch.setenv("FLASH_E2E_COMMIT", "61d2640")
    assert tree_commit(tmp_path) == "61d2640"
    monkeypatch.delenv("FLASH_E2E_COMMIT")
    assert tree_commit(tmp_path / "missing", unknown="?") == "?"
