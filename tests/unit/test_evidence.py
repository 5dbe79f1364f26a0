"""Results in benchmarks/ name the commit they were taken at, and stale ones say so
(issue 14). The table in PROVENANCE.md is checked against this branch's git history."""

from __future__ import annotations

import re
import subprocess
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
        changed = git("log", "--format=%h", f"{r['commit']}..HEAD", "--", *r["paths"]).stdout.split()
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
