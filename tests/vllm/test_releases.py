"""vllm tier: every patch against the real source of every supported release, on CPU.

Per release (environments from tools/check_vllm_release.py, built by tests/support/tier-vllm.sh):
1. `tools/check_vllm_release.py X.Y.Z --json` (0.29.0 and 0.33.0; the in-release session checks
   the same matrix on every release) reports, for every patch, exactly the status the registry
   declares for that base (applies / upstream / not-needed / not-ported), never broken.
2. The in-release checks (tests/vllm/release/check_*.py) run with that release's Python: the
   plugin registers through vLLM's loader and every patch's logic is exercised with the real
   vLLM classes. All must pass; none may be skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from flash_vllm import compat
from flash_vllm.registry import catalogue
from release_envs import RELEASES, TOOL
from release_envs import tool as _tool

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


# The tool end to end on the oldest and the newest release (the interface others rely on); the
# same matrix is asserted on every release inside the in-release session (check_selfcheck.py).
@pytest.mark.parametrize("release", [RELEASES[0], RELEASES[-1]])
def test_check_tool_matrix_matches_registry(release):
    proc = subprocess.run([sys.executable, str(TOOL), release, "--json"], capture_output=True,
                          text=True, timeout=1800)
    last = proc.stdout.strip().splitlines()[-1]
    result = json.loads(last)
    assert result["release"] == release
    base = compat.base_for_release(release)
    got = {p["number"]: (p["name"], p["status"]) for p in result["patches"]}
    want = {p.number: (p.name, p.expected_status(base)) for p in catalogue()}
    broken = {n: p for n, p in ((p["number"], p) for p in result["patches"]) if p["status"] == "broken"}
    assert not broken, f"broken on {release}: {broken}"
    assert got == want
    assert result["compile_key"]["status"] == "applies", result["compile_key"]
    assert proc.returncode == 0


@pytest.mark.parametrize("release", RELEASES)
def test_propose_matches_the_catalogue(release):
    """`--propose` on each real wheel proposes the entry the catalogue has (capabilities no source
    marker tells are flagged in the output and left out here)."""
    from flash_common import releases

    proc = subprocess.run([sys.executable, str(TOOL), release, "--propose", "--json"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = releases.by_version(release)
    assert got["torch"] == want.torch
    flagged = set(_tool().NOT_FROM_SOURCE)
    assert {k: v for k, v in got["caps"].items() if k not in flagged} == \
        {k: v for k, v in want.caps.items() if k not in flagged}


def test_fake_next_release_aliasing_the_newest_checks_clean(tmp_path):
    """The dry run of adding a release, on real source: a catalogue copy with a 0.34.0 entry that
    aliases the newest release, and the selfcheck run as that base on the newest release's source.
    Every patch the new entry classifies as applying must apply; the matrix equals the alias's."""
    from fakes.releases import fake_catalogue
    from flash_common import releases

    newest = releases.get(releases.NEWEST)
    root = fake_catalogue(tmp_path, version="0.34.0", alias=newest.version)
    rt = _tool().ensure(newest.version)
    env = dict(rt["env"], PYTHONPATH=os.pathsep.join([str(root), rt["env"]["PYTHONPATH"]]))
    proc = subprocess.run([rt["python"], "-m", "flash_vllm.selfcheck", "--json", "--assume-base", "v0.34"],
                          env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[-1])
    assert got["base"] == "v0.34" and got["release"] == newest.version
    assert {p["number"]: p["status"] for p in got["patches"]} == \
        {p.number: p.expected_status(newest.base) for p in catalogue()}
    assert proc.returncode == 0


@pytest.fixture(scope="module")
def tiny_hybrids(tmp_path_factory):
    """OUR writer's output (flash prepare hybrid on the TINY fakes, both layouts) for
    check_fp8_hybrid_ours.py: the proof that the hybrid and patch 6's native dispatch meet."""
    import os

    from fakes import ckpt
    from flash_cli import hfcache
    from flash_cli.checkpoint import hybrid

    root = tmp_path_factory.mktemp("hybrids")
    out = []
    for flavour in ("radixark", "nvidia"):
        snap = ckpt.write_snapshot(root / flavour / "hf", flavour)
        hybrid.prepare(snap)
        out.append(str(hfcache.variant_dir(snap, "hybrid")))
    return os.pathsep.join(out)


@pytest.fixture(scope="module")
def qad_snapshot(tmp_path_factory):
    """The QAD export's layout (tests/fakes/ckpt.py `qad`) for check_qad_layout.py."""
    from fakes import ckpt

    return str(ckpt.write_snapshot(tmp_path_factory.mktemp("qad") / "hf", "qad"))


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The gpu-e2e tier's tiny model in its three layouts (a, b, c) for check_tiny_model.py."""
    import os

    from fakes import tiny_model

    snaps = tiny_model.build(tmp_path_factory.mktemp("tiny") / "hf")
    return os.pathsep.join(str(snaps[k]) for k in "abc")


@pytest.mark.parametrize("release", RELEASES)
def test_patch_logic_in_release(release, tmp_path, tiny_hybrids, tiny_models, qad_snapshot):
    rt = _tool().ensure(release)
    rt["env"] = dict(rt["env"], FLASH_TEST_TINY_HYBRIDS=tiny_hybrids, FLASH_TEST_TINY_MODELS=tiny_models,
                     FLASH_TEST_QAD_SNAPSHOT=qad_snapshot, HF_HUB_OFFLINE="1")
    junit = tmp_path / "junit.xml"
    proc = subprocess.run(
        [rt["python"], "-m", "pytest", str(ROOT / "tests" / "vllm" / "release"), "-q",
         "-o", "python_files=check_*.py", "-p", "no:cacheprovider", f"--junitxml={junit}",
         "--rootdir", str(ROOT)],
        env=rt["env"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["failures"] == counts["errors"] == 0, proc.stdout[-6000:]
    assert counts["skipped"] == 0, f"skipped checks on {release}: {proc.stdout[-3000:]}"
    assert counts["tests"] >= 40, counts
    assert proc.returncode == 0, proc.stdout[-3000:]
