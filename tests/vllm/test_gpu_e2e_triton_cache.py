"""The gpu-e2e fleet's one Triton cache (harness_site/flash_e2e_triton_cache.py), proven with each
release's real compile-cache setup and the Triton its venv holds: after vLLM's
`InductorAdaptor.initialize_cache` has pointed TRITON_CACHE_DIR at the server's own compile cache
(unconditionally on 0.29: run41's boots compiled every kernel again, 94-117 s each), Triton's default
manager writes there, the fleet's writes to the shared directory and reads back what another server
wrote."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from release_envs import ensure

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu_e2e"))
import fleet  # noqa: E402

pytestmark = pytest.mark.vllm

CODE = """
import json, os, sys
from vllm.compilation.compiler_interface import InductorAdaptor
from triton.runtime import cache

server_cache = sys.argv[1]
try:
    adaptor = InductorAdaptor()
except TypeError:  # 0.33: keyword-only use_aot_compile
    adaptor = InductorAdaptor(use_aot_compile=False)
adaptor.initialize_cache(server_cache)  # what the engine does at its first compile
KEY = "0123456789abcdef" * 4  # Triton keys are hex digests
out = {"triton_cache_dir": os.environ.get("TRITON_CACHE_DIR")}
os.environ.pop("TRITON_CACHE_MANAGER", None)
out["default_dir"] = cache.get_cache_manager(KEY).cache_dir
os.environ["TRITON_CACHE_MANAGER"] = sys.argv[2]
m = cache.get_cache_manager(KEY)
out["class"] = type(m).__name__
out["shared_dir"] = m.cache_dir
out["written"] = m.put(b"kernel bytes", "kernel.cubin")
out["read_back"] = cache.get_cache_manager(KEY).get_file("kernel.cubin")
out["override_dir"] = cache.get_override_manager(KEY).cache_dir
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("version", ["0.29.0", "0.33.0"])
def test_shared_triton_cache(version, tmp_path):
    rt = ensure(version)
    shared = tmp_path / "shared-triton"
    env = dict(rt["env"])
    env.pop("TRITON_CACHE_DIR", None)
    env.update({"PYTHONPATH": os.pathsep.join([str(fleet.HARNESS_SITE), env.get("PYTHONPATH", "")]),
                "FLASH_E2E_TRITON_CACHE": str(shared), "TRITON_OVERRIDE_DIR": str(tmp_path / "override")})
    server = tmp_path / "vllm-cache" / "a-default" / "torch_compile_cache" / "h" / "rank_0_0"
    proc = subprocess.run([rt["python"], "-c", CODE, str(server), fleet.TRITON_CACHE_MANAGER], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    # vLLM moved Triton's cache under the server's compile cache; the default manager follows it
    assert out["triton_cache_dir"] == str(server / "triton_cache")
    assert out["default_dir"].startswith(str(server / "triton_cache"))
    # the fleet's manager does not: one directory for every server, read back by a new manager
    assert out["class"] == "SharedFileCacheManager"
    assert out["shared_dir"].startswith(str(shared) + os.sep)
    assert out["written"].startswith(str(shared) + os.sep) and Path(out["written"]).read_bytes() == b"kernel bytes"
    assert out["read_back"] == out["written"]
    assert out["override_dir"].startswith(str(tmp_path / "override"))  # a developer's override is kept
