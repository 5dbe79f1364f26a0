"""The compile-cache key on a real release: the hook binds, and vLLM's own AOT key tells patch states apart.

Each state boots the way a serving process does, in its own process: `flash_vllm.register()`
reads the environment, then the release's `aot_compile_hash_factors(VllmConfig)` (what names
`torch_compile_cache/torch_aot_compile/<hash>`, less the forward's qualname) is computed with
our hook and with vLLM's `compute_hash` alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import hashlib, json
from flash_vllm import plugin
summary = plugin.register()  # from os.environ, like a serving process
from vllm import envs
from vllm.compilation.caching import aot_compile_hash_factors
from vllm.config import DeviceConfig, VllmConfig
from flash_vllm.registry import original

def key(cfg):
    f = aot_compile_hash_factors(cfg)
    return {"env": f[0], "config": f[1], "dir": hashlib.sha256(str(f).encode()).hexdigest()}

cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
hooked = key(cfg)
VllmConfig.compute_hash = original(VllmConfig.compute_hash)  # vLLM alone
plain = key(cfg)
print(json.dumps({"summary": summary, "aot": bool(envs.VLLM_USE_AOT_COMPILE), "hooked": hooked, "plain": plain}))
"""

RECIPE = {"VLLM_PLE_MMAP": "1", "VLLM_QSA_EXACT_TOPK": "1"}  # patch 1 (eager) and exact top-k, as served
STATES = {
    "recipe": RECIPE,
    # what must not cost a recompile: ports, paths, worker counts, I/O tuning
    "recipe-moved": {**RECIPE, "VLLM_PORT": "8123", "VLLM_PLE_MMAP_DIR": "/srv/elsewhere",
                     "VLLM_PLE_MMAP_WORKERS": "7", "VLLM_PLE_MMAP_IO": "mmap"},
    "ple-off": {**RECIPE, "VLLM_PLE_MMAP": "0"},                  # patch 1 toggled
    "topk-off": {**RECIPE, "VLLM_QSA_EXACT_TOPK": "0"},           # patch 5 toggled
    "topk-fill": {**RECIPE, "VLLM_QSA_EXACT_TOPK": "fill"},       # patch 5's traced-code mode
}


@pytest.fixture(scope="module")
def boots(tmp_path_factory):
    out = {}
    for name, extra in STATES.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_PLE_MMAP", "VLLM_QSA_", "FLASH_DISABLE"))}
        env.update(extra, VLLM_CACHE_ROOT=str(tmp_path_factory.mktemp(name)))
        proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_aot_compile_is_on_by_default_here(boots):
    """The premise: this release with its torch pin AOT-compiles (the key that was blind to us)."""
    assert all(b["aot"] for b in boots.values())


def test_vllm_alone_cannot_tell_the_patch_states_apart(boots):
    """Without the hook, patch 5 on, off or in its other mode gets one AOT directory: the bug the key
    fixes, on this release. (Patch 1 on/off is told apart on 0.29 by vLLM itself, by accident: its
    splitting op lands in the compilation config; its modes and the other patches are not.)"""
    same = ("recipe", "recipe-moved", "topk-off", "topk-fill")
    assert len({boots[n]["plain"]["dir"] for n in same}) == 1
    assert 5 in boots["recipe"]["summary"]["applied"] and 5 not in boots["topk-off"]["summary"]["applied"]


def test_the_key_tells_them_apart_and_only_them(boots):
    hooked = {n: b["hooked"]["dir"] for n, b in boots.items()}
    assert hooked["recipe"] == hooked["recipe-moved"]          # same traced code: the artifact is reused
    assert len({hooked[n] for n in ("recipe", "ple-off", "topk-off", "topk-fill")}) == 4
    assert 1 in boots["recipe"]["summary"]["applied"] and 1 not in boots["ple-off"]["summary"]["applied"]


def test_the_key_enters_through_compute_hash_only(boots):
    from flash_vllm import compile_key

    for name, b in boots.items():
        assert b["hooked"]["env"] == b["plain"]["env"], name  # vLLM's env factors untouched
        assert b["hooked"]["config"] == compile_key.mix(b["plain"]["config"], b["summary"]["compile_key"]), name


def test_hook_binds_in_this_process(registered, gates, vllm_config):
    from vllm.config import VllmConfig

    from flash_vllm import compile_key
    from flash_vllm.registry import is_ours

    assert is_ours(VllmConfig.compute_hash, compile_key.MARK)
    compile_key.verify()
    assert registered["compile_key"] == compile_key.current()
    wrap = VllmConfig.compute_hash
    cfg = vllm_config
    before = cfg.compute_hash()
    plain = wrap.__flash_original__(cfg)
    assert before == compile_key.mix(plain, registered["compile_key"]) != plain and len(before) == len(plain)
    # installing again (a second register() of this process) binds nothing new
    from flash_vllm import compat
    from flash_vllm.registry import Context

    ctx = Context(compat.resolve(registered["vllm"], {}), gates)  # the env register() had
    again = compile_key.install(ctx, registered["applied"])
    assert VllmConfig.compute_hash is wrap and again["key"] == registered["compile_key"]
    assert cfg.compute_hash() == before


def test_selfcheck_reports_the_key(registered, gates):
    """The image build's selfcheck proves the hook binds on this release (and exits 1 if not)."""
    from flash_vllm import compat, compile_key
    from flash_vllm.registry import Context
    from flash_vllm.selfcheck import evaluate_key

    ctx = Context(compat.resolve(registered["vllm"], {}), gates)
    row = evaluate_key(ctx, [{"number": n, "status": "applies"} for n in registered["applied"]])
    assert row == {"status": "applies", "detail": f"vllm.config.vllm:VllmConfig.compute_hash (key {registered['compile_key']})"}
    assert compile_key.current() == registered["compile_key"]
