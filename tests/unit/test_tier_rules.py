"""tests/run: a selected GPU tier on a machine without CUDA exits non-zero with a clear message,
before installing anything (issue 14). Generic: any tier named gpu-* (gpu-e2e, …) too. And a GPU
test that skips inside a selected GPU tier fails (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_tiers(tmp_path, *tiers, smi_rc=9):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"  # a machine without a GPU: the driver tool is absent or fails
    smi.write_text(f"#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\nexit {smi_rc}\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FLASH_VENV": str(tmp_path / "never-created")}
    return subprocess.run(["bash", str(ROOT / "tests" / "run"), *tiers], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("tiers", [("gpu",), ("gpu-e2e",), ("unit", "gpu")])
def test_gpu_tier_without_cuda_fails_loudly_before_installing(tmp_path, tiers):
    res = run_tiers(tmp_path, *tiers)
    assert res.returncode == 3, res.stdout + res.stderr
    gpu = [t for t in tiers if t.startswith("gpu")]
    assert f"tier(s) {' '.join(gpu)} need an NVIDIA GPU with CUDA, and this machine has none" in res.stderr
    assert "could not communicate with the NVIDIA driver" in res.stderr
    assert not (tmp_path / "never-created").exists()  # stopped before building a venv


def test_a_misspelt_tier_fails_at_once_naming_the_tiers(tmp_path):
    res = run_tiers(tmp_path, "unit", "unti")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "unknown tier 'unti'; the tiers: unit engine obs vllm scale fuzz gpu gpu-e2e" in res.stderr
    assert not (tmp_path / "never-created").exists()  # nothing installed first


def test_a_skipping_gpu_test_fails_in_a_gpu_tier(tmp_path):
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_g.py").write_text(textwrap.dedent("""
        import pytest
        @pytest.mark.gpu
        def test_needs_cuda():
            pytest.skip("CUDA unavailable")
        def test_plain_skip():
            pytest.skip("not a GPU test")
    """))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  gpu: g\n")
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "FLASH_REQUIRE_GPU"}
    res = subprocess.run(base, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "2 skipped" in res.stdout, res.stdout
    # each tier's skip reasons apart (README promises them per tier), counted
    gpu, unit = res.stdout.split("gpu tier: 1 of 1 skipped")[1].split("unit tier: 1 of 1 skipped")
    assert "1 x CUDA unavailable" in gpu and "not a GPU test" not in gpu
    assert "1 x not a GPU test" in unit
    res = subprocess.run(base, cwd=tmp_path, env={**env, "FLASH_REQUIRE_GPU": "1"}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1 and "1 failed, 1 skipped" in res.stdout, res.stdout
    assert "FAILED test_g.py::test_needs_cuda - skipped inside a selected GPU tier" in res.stdout


def test_readme_says_where_each_tier_runs():
    """README's test table names every tier tests/run knows and where it runs: CI's default set
    (tests/run with no argument) as CI, GPU tiers as the GPU machine."""
    run = (ROOT / "tests" / "run").read_text()
    default = run.split("|| tiers=(", 1)[1].split(")", 1)[0].split()
    readme = (ROOT / "README.md").read_text()
    where = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`tests/run"):
            where[cells[0]] = cells[2]
    for tier in default:
        assert where.get(tier, "").startswith("CI"), (tier, where)
    assert "GPU machine" in where["gpu"]
    assert any(t.startswith("gpu-") and "GPU machine" in w for t, w in where.items())
    assert "CI (`.ci/run`) runs `tests/run` with no arguments" in readme
