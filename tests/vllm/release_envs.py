"""The per-release CPU environments of the vllm tier, from tools/check_vllm_release.py (one loader
for every test that runs something inside a release's venv)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from flash_common import releases

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_vllm_release.py"
RELEASES = [r.version for r in releases.RELEASES]
_tool_module = None


def tool():
    """tools/check_vllm_release.py as a module (a script, not a package: loaded by path, once)."""
    global _tool_module
    if _tool_module is None:
        spec = importlib.util.spec_from_file_location("check_vllm_release", TOOL)
        _tool_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_tool_module)
    return _tool_module


def ensure(release: str) -> dict:
    """That release's environment (python, env), built or reused."""
    return tool().ensure(release)
