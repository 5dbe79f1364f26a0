"""The gpu-e2e tier's broken-patch boot, proven on CPU with each release's real source: the breaker's
copy of the module that holds patch 1's forward anchor (fleet.breaker(base): `ngram_embedding` on
0.30+, `ple_layer` on 0.29; the anchor moved, same code) makes `register()` refuse, naming patch 1;
without it the same call applies every patch, patch 1 among them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flash_common import releases
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
print("APPLIED:", s["base"], s["applied"])
"""


@pytest.mark.parametrize("broken", [True, False])
@pytest.mark.parametrize("version", ["0.29.0", "0.33.0"])
def test_breaker_makes_patch_1_refuse(version, broken, tmp_path):
    base = releases.by_version(version).base
    brk = fleet.breaker(base)
    assert brk is not None, f"no breaker for {base}"
    rt = ensure(version)
    env = dict(rt["env"])
    env["PYTHONPATH"] = os.pathsep.join([str(fleet.ROOT / "tests" / "gpu_e2e" / "breaker"), env.get("PYTHONPATH", "")])
    if broken:
        env["FLASH_E2E_BREAK"] = json.dumps({k: brk[k] for k in ("module", "old", "new")})
        env["FLASH_E2E_BREAK_DIR"] = str(tmp_path)
    proc = subprocess.run([rt["python"], "-c", CODE], env=env, capture_output=True, text=True, timeout=900)
    if broken:
        assert proc.returncode == 7, proc.stdout + proc.stderr[-3000:]
        assert f"flash_vllm patch 1 ({brk['name']}) cannot apply on {base}" in proc.stdout
        # the anchor patch 1's check names there (p01_ple_mmap.check / p01_ple_mmap.v029.check)
        splitting = releases.cap(base, "ple_storage") == "splitting-op"
        anchor = "self.ngram_embedding(ngram_ids).flatten(-2)" if splitting else "embedding(ngram_ids).flatten(-2)"
        assert f"Qwen4ExpNGramEmbedding.forward no longer contains [{anchor!r}]" in proc.stdout, proc.stdout
        assert f"FLASH_E2E_BREAK applied: {brk['module']}" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert f"APPLIED: {base} [1," in proc.stdout
