"""Tests that cannot pass by skipping (issue 14). With the PLE table made to refuse an io mode that
works on this machine, the PLE tests of that mode must fail; before, they skipped on any open
error and the tier stayed green. Runs a narrow selection of the real tests in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ple_io import direct_missing, uring_missing

ROOT = Path(__file__).resolve().parents[2]


def run_broken(io: str, *selection: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLASH_BREAK_PLE_IO": io,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "break_ple_io", "-q", "-p", "no:cacheprovider",
                           *selection], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def outcome(res) -> str:
    return res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-500:]


@pytest.mark.parametrize("io,selection", [
    ("mmap", ["tests/unit/test_ple_table.py::test_gather_bit_identical[radixark-48-mmap]"]),
    ("mmap", ["tests/unit/test_ple_native.py::test_gather_bit_identical_native_and_numpy[nvidia-48-mmap-False]"]),
])
def test_a_broken_mmap_path_fails_the_ple_tests(io, selection):
    res = run_broken(io, *selection)
    last = outcome(res)
    assert res.returncode == 1 and "failed" in last and "skipped" not in last, res.stdout[-3000:]
    assert "broken on purpose by break_ple_io: io=mmap" in res.stdout


def test_a_broken_uring_path_fails_where_io_uring_works():
    if uring_missing():
        pytest.skip(uring_missing())
    res = run_broken("uring", "tests/unit/test_ple_table.py::test_gather_bit_identical[nvidia-48-uring]")
    last = outcome(res)
    assert res.returncode == 1 and "failed" in last and "skipped" not in last, res.stdout[-3000:]


def test_probe_reasons_name_the_missing_feature(tmp_path):
    for reason in (uring_missing(), direct_missing(tmp_path)):
        assert reason is None or ("io_uring" in reason or "O_DIRECT" in reason)


def test_only_a_declared_gpu_e2e_na_skip_survives_a_gpu_tier(tmp_path):
    # the real tests/conftest.py as a plugin over three skipping GPU tests: only the gpu-e2e one whose
    # reason is the fleet's "N/A on vX.Y: ..." stays a skip; the other two fail the tier
    (tmp_path / "test_tier.py").write_text(
        "import pytest\n"
        "@pytest.mark.gpu_e2e\n"
        "def test_na():\n    pytest.skip('N/A on v0.29: PLE_MODE=hoisted is not served on v0.29')\n"
        "@pytest.mark.gpu_e2e\n"
        "def test_no_cuda():\n    pytest.skip('no CUDA device')\n"
        "@pytest.mark.gpu\n"
        "def test_na_outside_e2e():\n    pytest.skip('N/A on v0.29: not a gpu-e2e scenario')\n")
    env = {**os.environ, "FLASH_REQUIRE_GPU": "1", "PYTHONPATH": str(ROOT / "tests")}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-c", os.devnull,
                          "-rA", str(tmp_path / "test_tier.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 1, res.stdout[-2000:]
    assert "2 failed, 1 skipped" in outcome(res), res.stdout[-2000:]
    assert "SKIPPED [1] " in res.stdout and "N/A on v0.29: PLE_MODE=hoisted" in res.stdout
    assert "FAILED" in res.stdout and "test_no_cuda" in res.stdout and "test_na_outside_e2e" in res.stdout


# rc 5 without the rule: only skips, nothing ran (tests/run fails an empty run too)
@pytest.mark.parametrize("require,rc", [("1", 2), ("", 5)])
def test_a_module_level_skip_fails_a_gpu_tier(tmp_path, require, rc):
    # issue 33: tests/gpu's modules skip at import when torch is missing (module-level importorskip);
    # such a collection skip never reached the per-test rule above and the tier stayed green
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    (gpu / "test_needs_cuda.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "pytest.importorskip('flash_no_such_module_xyz')\n"
        "def test_kernel():\n    assert True\n")
    (tmp_path / "test_elsewhere.py").write_text(  # a module outside the GPU folders may still skip
        "import pytest\npytest.importorskip('flash_no_such_module_xyz')\n")
    env = {**os.environ, "FLASH_REQUIRE_GPU": require, "PYTHONPATH": str(ROOT / "tests")}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-c", os.devnull,
                          "-rA", str(gpu), str(tmp_path / "test_elsewhere.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == rc, res.stdout[-2000:]
    if require:
        assert "test_needs_cuda.py skipped as a whole inside a selected GPU tier" in res.stdout, res.stdout[-2000:]
        assert "flash_no_such_module_xyz" in res.stdout and "1 skipped" in outcome(res), res.stdout[-2000:]
    else:
        assert "2 skipped" in outcome(res), res.stdout[-2000:]
