"""lab/ and tools/ as packages: importable as modules, nothing edits sys.path by hand, and the parts
the device runs before any project venv exists work with the standard library and src/ alone."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYS_PATH_EDIT = re.compile(r"sys\.path\s*(\.insert|\.append|\.extend|\[[^\]]*\]\s*=|\+=|=)")


def _modules(folder: str) -> list[str]:
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / folder).rglob("*.py")
                  if p.name != "__init__.py")


def test_no_tool_edits_sys_path():
    offenders = [f"{p.relative_to(ROOT)}:{n}" for folder in ("lab", "tools") for p in (ROOT / folder).rglob("*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if SYS_PATH_EDIT.search(line)]
    assert not offenders, f"add the package to the environment instead of editing sys.path: {offenders}"


@pytest.mark.parametrize("name", _modules("lab") + _modules("tools"))
def test_every_module_imports_as_part_of_its_package(name):
    assert importlib.import_module(name).__name__ == name


def _bare(*argv: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    """This interpreter without site-packages (-S: no project venv, as on the device), from the
    repository root, with only `pythonpath` added."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": pythonpath} if pythonpath else {})
    return subprocess.run([sys.executable, "-S", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_device_payload_needs_only_the_standard_library():
    r = _bare("-m", "lab.device_payload", "--help")
    assert r.returncode == 0 and "receive" in r.stdout and "install" in r.stdout, r.stderr


def test_gpu_session_checks_run_on_src_alone():
    """`gpu_session.sh start` asks the benches which configs exist before anything is installed:
    with the tree's src/ on PYTHONPATH and no site-packages, and not without src/."""
    r = _bare("-m", "lab.bench_decode", "configs", pythonpath=str(ROOT / "src"))
    assert r.returncode == 0 and r.stdout.strip().split(",")[:3] == ["stock", "eager", "hoisted"], r.stderr
    r = _bare("-m", "lab.bench_recipe", "configs", "stock,default,nvidia", pythonpath=str(ROOT / "src"))
    assert r.returncode == 0 and r.stdout.strip() == "stock,default,nvidia", r.stderr
    r = _bare("-m", "lab.bench_decode", "configs")
    assert r.returncode != 0 and "No module named 'flash_vllm'" in r.stderr
