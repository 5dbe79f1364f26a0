"""Results in benchmarks/ name the commit they were taken at, and stale ones say so
(issue 14). The table in PROVENANCE.md is checked against this branch's git history."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
NOT_RESULTS = {"README.md", "PROVENANCE.md"}


def rows() -> dict[str, dict]:
    out = {}
    for line in (BENCH / "PROVENANCE.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("file",) and not set(cells[0]) <= {"-"}:
            out[cells[0]] = {"commit": cells[1], "how": cells[2], "paths": cells[3].split(), "status": cells[4]}
    return out


def git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def history():
    if git("rev-parse", "--git-dir").returncode != 0:
        pytest.fail("benchmarks/ provenance needs a git checkout (the commits are checked against history)")


def test_every_results_file_has_a_row():
    files = {str(p.relative_to(BENCH)) for p in BENCH.rglob("*") if p.is_file() and str(p.relative_to(BENCH)) not in NOT_RESULTS}
    table = rows()
    assert not files - set(table), f"results without a PROVENANCE.md row: {sorted(files - set(table))}"
    assert not set(table) - files, f"PROVENANCE.md rows without a file: {sorted(set(table) - files)}"


@functools.cache
def renames() -> tuple[tuple[str, str, str], ...]:
    """(commit, old path, new path) of every rename git finds in this branch's history."""
    out, sha = [], ""
    for line in git("log", "-M", "--diff-filter=R", "--name-status", "--format=%H", "HEAD").stdout.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0].startswith("R"):
            out.append((sha, parts[1], parts[2]))
        elif line.strip():
            sha = line.strip()
    return tuple(out)


@functools.cache
def pure_moves(sha: str) -> tuple[set[str], set[str]]:
    """What one commit did: (paths it only moved, old and new side of each 100%-similar rename;
    paths it changed in any other way)."""
    moved, touched = set(), set()
    for line in git("show", "-M", "--name-status", "--format=", sha).stdout.splitlines():
        parts = line.split("\t")
        if parts[0] == "R100":
            moved.update(parts[1:])
        elif len(parts) >= 2:
            touched.update(parts[1:])
    return moved, touched


def under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def code_changes(commit: str, paths: list[str]) -> list[str]:
    """The commits after `commit` that changed the code at `paths`, following renames the way
    `git log --follow` does for one file: a row may name where the code lives now, so the code's
    earlier paths (renamed after `commit`) count too, and a commit that only moved it (a 100%
    rename, content unchanged) is not a change to what was measured."""
    since = set(git("rev-list", f"{commit}..HEAD").stdout.split())
    followed, grew = set(paths), True
    while grew:  # chains: a -> b -> c
        grew = False
        for sha, old, new in renames():
            if sha in since and under(new, followed) and old not in followed:
                followed.add(old)
                grew = True
    shas = git("log", "--format=%H", f"{commit}..HEAD", "--", *sorted(followed)).stdout.split()
    changed = []
    for sha in shas:
        moved, touched = pure_moves(sha)
        if any(under(p, followed) for p in touched) or not any(under(p, followed) for p in moved):
            changed.append(sha[:7])
    # an edit later undone (the code where it was, byte for byte) changed nothing that was measured
    if changed and followed == set(paths) and git("diff", "--quiet", commit, "HEAD", "--", *paths).returncode == 0:
        return []
    return changed


def test_commits_exist_and_stale_rows_say_so(history):
    problems = []
    for name, r in rows().items():
        if not re.fullmatch(r"[0-9a-f]{7,40}", r["commit"]):
            problems.append(f"{name}: 'taken at' {r['commit']!r} is not a commit id")
            continue
        if git("merge-base", "--is-ancestor", r["commit"], "HEAD").returncode != 0:
            problems.append(f"{name}: commit {r['commit']} is not in this branch's history")
            continue
        missing = [p for p in r["paths"] if not (ROOT / p).exists()]
        changed = code_changes(r["commit"], r["paths"])
        if (changed or missing) and not r["status"].startswith("stale"):
            problems.append(f"{name}: {r['paths']} changed in {len(changed)} commit(s) after {r['commit']} "
                            f"({', '.join(changed[:3])}{' …' if len(changed) > 3 else ''}){' (gone: ' + str(missing) + ')' if missing else ''}"
                            ": re-run it or mark it stale")
        if r["status"] not in ("current",) and not r["status"].startswith("stale:"):
            problems.append(f"{name}: status {r['status']!r} is neither 'current' nor 'stale: why'")
    assert not problems, "\n".join(problems)


def test_readme_no_longer_claims_no_gpu_results():
    text = (BENCH / "README.md").read_text()
    assert "No GPU results are recorded here" not in text and "PROVENANCE.md" in text


def test_a_pure_move_is_not_a_change_but_edits_before_and_after_it_are(tmp_path, monkeypatch):
    """code_changes on a real repository: a row naming where the code lives now sees the edits made
    at its old path before the move and at the new path after it; the move itself is no change."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", repo)
    renames.cache_clear()
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]

    def commit(msg: str) -> str:
        assert git("add", "-A").returncode == 0
        assert git(*ident, "commit", "-qm", msg).returncode == 0
        return git("rev-parse", "--short=7", "HEAD").stdout.strip()

    assert git("init", "-q").returncode == 0
    (repo / "tools" / "a.py").write_text("".join(f"a = {i}\n" for i in range(40)))
    (repo / "tools" / "b.py").write_text("".join(f"b = {i}\n" for i in range(40)))
    taken = commit("add")
    (repo / "tools" / "b.py").write_text("".join(f"b = {i}\n" for i in range(41)))
    edit_b = commit("edit b")
    (repo / "lab").mkdir()
    assert git("mv", "tools/a.py", "tools/b.py", "lab/").returncode == 0
    moved = commit("move")
    assert code_changes(taken, ["lab/a.py"]) == []
    assert code_changes(taken, ["lab/b.py"]) == [edit_b]
    assert code_changes(taken, ["lab"]) == [edit_b]
    assert code_changes(moved, ["lab/b.py"]) == []
    (repo / "lab" / "a.py").write_text("a = 0\n")
    renames.cache_clear()
    edit_a = commit("edit a")
    assert code_changes(taken, ["lab/a.py"]) == [edit_a]
    # an edit undone at the same path: no net change since the row's commit, so none counted
    (repo / "lab" / "c.py").write_text("c = 1\n")
    at_c = commit("add c")
    (repo / "lab" / "c.py").write_text("c = 2\n")
    edit_c = commit("edit c")
    assert code_changes(at_c, ["lab/c.py"]) == [edit_c]
    (repo / "lab" / "c.py").write_text("c = 1\n")
    commit("undo c")
    assert code_changes(at_c, ["lab/c.py"]) == []
    renames.cache_clear()
