"""What adding a vLLM release touches, counted rather than claimed.

A copy of the repository (its tracked files) gets the one hand edit a release needs: a catalogue
entry in src/flash_common/releases.py (0.34.0 with 0.33.0's pins and capabilities, a release that
changes nothing we depend on). Then every generator (`tools/gen_*.py`) runs and the golden run
specs are rewritten, as the procedure in docs/PATCHES.md says. The files that now differ from the
checkout are the files an addition touches; the procedure must name exactly those, with their
number. The vllm tier's release list must follow the catalogue with no edit of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fakes.releases import with_release
from flash_common import releases

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = "src/flash_common/releases.py"
# The unit tests that hold the golden run specs (FLASH_UPDATE_GOLDEN=1 rewrites them).
GOLDEN_TESTS = ("tests/unit/test_runspec.py::test_profile_matches_golden",
                "tests/unit/test_multinode.py::test_each_box_matches_golden",
                "tests/unit/test_multinode.py::test_pd_router_matches_golden")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]


def run(argv: list[str], cwd: Path, **env: str) -> None:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BASE", "FLASH_UPDATE_GOLDEN")}
    proc = subprocess.run(argv, cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{argv} in the copy: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


def touched(tmp: Path, current: bool) -> set[str]:
    """The files that differ from the checkout after adding 0.34.0 to a copy and regenerating."""
    files = tracked()
    for rel in files:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp / rel)
    cat = tmp / CATALOGUE
    cat.write_text(with_release(cat.read_text(), "0.34.0", releases.get(releases.NEWEST).version, current=current))
    copy_path = os.pathsep.join([str(tmp / "src"), str(tmp)])  # the copy's packages before the installed ones
    for gen in sorted((tmp / "tools").glob("gen_*.py")):
        run([sys.executable, str(gen)], tmp, PYTHONPATH=copy_path)
    run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GOLDEN_TESTS], tmp,
        PYTHONPATH=os.pathsep.join([copy_path, str(tmp / "tests")]), FLASH_UPDATE_GOLDEN="1")
    changed = {rel for rel in files if (tmp / rel).read_bytes() != (ROOT / rel).read_bytes()}
    # a generator or the golden run that writes a file the checkout does not track counts too
    made = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"} - set(files)
    return changed | made


def procedure() -> str:
    doc = (ROOT / "docs" / "PATCHES.md").read_text()
    return doc[doc.index("## Adding a vLLM release"):]


def named(text: str) -> set[str]:
    return set(re.findall(r"`([\w./-]+\.(?:py|md|txt|json)|Dockerfile[\w.]*)`", text))


@pytest.fixture(scope="module")
def added(tmp_path_factory):
    return touched(tmp_path_factory.mktemp("release-added"), current=False)


@pytest.fixture(scope="module")
def made_current(tmp_path_factory):
    return touched(tmp_path_factory.mktemp("release-current"), current=True)


def test_a_new_release_touches_the_files_the_procedure_names(added):
    text = procedure()
    m = re.search(r"Files a real addition touches: \*\*(\d+)\*\*(.*?)\n\n", text, re.S)
    assert m, "docs/PATCHES.md's procedure no longer states the count (tools/gen_patches_doc.py ADDING)"
    assert int(m.group(1)) == len(added) == 5, sorted(added)
    assert named(m.group(2)) == added, sorted(added)
    assert CATALOGUE in added  # the one hand edit; the rest is regenerated


def test_making_it_current_touches_the_files_the_procedure_names(made_current, added):
    text = procedure()
    m = re.search(r"Making it the current base.*?\*\*(\d+)\*\* files(.*?)\n\n", text, re.S)
    assert m, "docs/PATCHES.md's procedure no longer states the count for a new current base"
    assert int(m.group(1)) == len(made_current), sorted(made_current)
    goldens = {f for f in made_current if f.startswith("tests/golden/")}
    g = re.search(r"the (\d+) golden run specs", m.group(2))
    assert g and int(g.group(1)) == len(goldens), sorted(goldens)
    assert named(m.group(2)) | goldens | added == made_current, sorted(made_current - added)


def test_the_vllm_tier_sets_up_every_catalogued_release(tmp_path):
    """tests/support/tier-vllm.sh reads the catalogue: a new entry joins the tier by itself."""
    out = subprocess.run([str(ROOT / "tests" / "support" / "tier-vllm.sh"), "--list"], capture_output=True,
                         text=True, check=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.stdout.split() == [r.version for r in releases.RELEASES]
    copy = tmp_path / "repo"
    for rel in ("tests/support/tier-vllm.sh", *(f"src/flash_common/{f.name}" for f in
                                                 (ROOT / "src" / "flash_common").glob("*.py"))):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, copy / rel)
    cat = copy / CATALOGUE
    cat.write_text(with_release(cat.read_text(), "0.34.0", "0.33.0", current=False))
    out = subprocess.run([str(copy / "tests" / "support" / "tier-vllm.sh"), "--list"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == [r.version for r in releases.RELEASES] + ["0.34.0"]
    bad = subprocess.run([str(ROOT / "tests" / "support" / "tier-vllm.sh"), "0.33.0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument 0.33.0 (accepted: --list)" in bad.stderr
