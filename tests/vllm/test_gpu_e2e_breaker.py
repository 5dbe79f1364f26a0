"""The gpu-e2e tier's broken-patch boot, proven on CPU with vLLM 0.33.0's real source: the breaker's
copy of `ngram_embedding` (patch 1's anchor moved, same code) makes `register()` refuse, naming patch 1;
without it the same call applies every patch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from release_envs import ensure

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu_e2e"))
import fleet  # noqa: E402

pytestmark = pytest.mark.vllm
CODE = """
import sys
from flash_vllm import plugin
try:
    s = plugin.register(env={"VLLM_PLE_MMAP": "1"})
except plugin.PatchFailed as e:
    print("REFUSED:", e)
    sys.exit(7)
print("APPLIED:", s["applied"])
"""


@pytest.mark.parametrize("broken", [True, False])
def test_breaker_makes_patch_1_refuse(broken, tmp_path):
    rt = ensure("0.33.0")
    env = dict(rt["env"])
    env["PYTHONPATH"] = os.pathsep.join([str(fleet.ROOT / "tests" / "gpu_e2e" / "breaker"), env.get("PYTHONPATH", "")])
    if broken:
        env["FLASH_E2E_BREAK"] = json.dumps({k: fleet.BREAK[k] for k in ("module", "old", "new")})
        env["FLASH_E2E_BREAK_DIR"] = str(tmp_path)
    proc = subprocess.run([rt["python"], "-c", CODE], env=env, capture_output=True, text=True, timeout=900)
    if broken:
        assert proc.returncode == 7, proc.stdout + proc.stderr[-3000:]
        assert f"flash_vllm patch 1 ({fleet.BREAK['name']}) cannot apply" in proc.stdout
        assert "FLASH_E2E_BREAK applied" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert "APPLIED: [1," in proc.stdout
