"""The per-release CPU environments of the vllm tier, from tools/check_vllm_release.py (one loader
for every test that runs something inside a release's venv)."""

from __future__ import annotations

from pathlib import Path

from flash_common import releases

from tools import check_vllm_release

TOOL = Path(check_vllm_release.__file__)  # run as a script by the tests of its command line
RELEASES = [r.version for r in releases.RELEASES]


def tool():
    """tools/check_vllm_release.py, the module that builds and keeps the release environments."""
    return check_vllm_release


def ensure(release: str) -> dict:
    """That release's environment (python, env), built or reused."""
    return tool().ensure(release)
