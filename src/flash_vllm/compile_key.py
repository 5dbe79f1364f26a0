"""The plugin's state in vLLM's compile-cache key.

vLLM keys its compile caches on `VllmConfig.compute_hash()` plus the env factors of *known*
vLLM variables (`envs.compile_factors()`); the AOT artifact (on by default with torch >= 2.10,
every release we serve) is keyed before tracing (`aot_compile_hash_factors`), and a load checks
only that the traced files' contents are unchanged. Our patches are switched by variables vLLM
does not know (`VLLM_PLE_MMAP*`, `VLLM_QSA_*`, `FLASH_DISABLE_PATCHES`), so with a persistent cache
(flash's `COMPILE_CACHE` volume) two boots that differ only in which patches are on, or in a
patch's mode, got the same key and the second loaded the graph traced with the first's code.

`install(ctx, applied)` (called by `register()` after the patches, in every vLLM process) wraps
`VllmConfig.compute_hash` so that vLLM's own hash is mixed with the flash key: every cache vLLM
keys on the config hash (AOT artifacts, the Inductor cache directory, the startup plan) then
tells patch states apart. The key is the sha256 of `signature()`:

- `base`: the release line the patches were chosen for;
- `applied`: the numbers of the patches applied in this process;
- `knobs`: per applied patch, the env-selected state that changes the code torch.compile traces
  (`TRACED`), normalised (unset and the default are the same state);
- `source`: a hash of the plugin's own source (`flash_vllm/**/*.py`, `flash_common/*.py`), so a
  new flash version never reuses an old artifact.

Everything else is left out on purpose (`NOT_TRACED` says why for each variable the patches
read): ports, paths, worker counts and I/O tuning do not change the traced code, and hashing
them would recompile on every boot that moves them. The unit tier fails when a patch reads a
variable that is in neither table.

Why a wrap of `compute_hash` and not `additional_config["flash"]` (which `compute_hash` also
hashes): the wrap acts in the process that compiles, from that process's own applied patches,
whatever built or copied the config; `additional_config` is filled once where the config is
built (the API server) and travels pickled, may be a user's `--additional-config` object
rather than a dict, and would show up in the user's config. `VllmConfig.compute_hash` exists,
unchanged in role, on 0.29.0-0.33.0 (0.29's takes no `include_version`; the wrap passes
arguments through). The key is always on: it is not a numbered patch, so FLASH_DISABLE_PATCHES
cannot switch it off and bring the shared-artifact bug back.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .registry import Context, TargetMissing, install as _install, is_ours, resolve

log = logging.getLogger("vllm.flash")

TARGET = ("vllm.config.vllm", "VllmConfig.compute_hash")
MARK = 0  # the registry's replacement mark; 0: not a numbered patch (patches count from 1)
VERSION = 1  # of the signature's layout


def _ple(env: Mapping[str, str]) -> dict:
    from .ple.config import config_from_env

    cfg = config_from_env(env)
    # mode: eager gathers inside the forward, hoisted before it (0.30+); debug swaps in the
    # cross-checking forward; hoist_check adds the id comparison to the hoisted forward.
    return {"mode": cfg.mode, "debug": cfg.debug, "hoist_check": cfg.hoist_check}


def _qsa_topk(env: Mapping[str, str]) -> dict:
    from .patches._qsa_topk import mode

    return {"topk": mode(env) or "stock"}  # patches 5 and 8 share one hook; the mode picks its body


# patch number -> the traced-code state it takes from the env, and the variables that state reads.
TRACED: dict[int, tuple[Callable[[Mapping[str, str]], dict], tuple[str, ...]]] = {
    1: (_ple, ("VLLM_PLE_MMAP_MODE", "VLLM_PLE_MMAP_DEBUG", "VLLM_PLE_MMAP_HOIST_CHECK")),
    5: (_qsa_topk, ("VLLM_QSA_EXACT_TOPK", "VLLM_QSA_DET_TOPK")),
    8: (_qsa_topk, ("VLLM_QSA_EXACT_TOPK", "VLLM_QSA_DET_TOPK")),
}

_GATE = "a patch's on/off gate: whether it applies is in `applied`"
_PLE_ENGINE = ("the PLE engine's {}: the gather runs outside the traced graph (an eager break on "
               "0.30+, the vllm::flash_ple_mmap_lookup splitting op on 0.29)")
NOT_TRACED: dict[str, str] = {
    "FLASH_DISABLE_PATCHES": _GATE,
    "VLLM_PLE_MMAP": _GATE,
    "FLASH_EFFORT_ALIAS": _GATE + " (and patch 12 rewrites requests, not the model)",
    "VLLM_FP8_HYBRID": "informational: patch 6 ships no code (the checkpoint's quant config decides)",
    "VLLM_MTP_DRAFT_VOCAB": ("patch 10's id set (a path) is read by Qwen4ExpMTP.compute_logits, which vLLM "
                             "does not compile; whether patch 10 applies is in `applied`"),
    "VLLM_PLE_MMAP_DIR": _PLE_ENGINE.format("source directory (a path)"),
    "VLLM_PLE_MMAP_WORKERS": _PLE_ENGINE.format("thread pool size"),
    "VLLM_PLE_MMAP_PREWARM": _PLE_ENGINE.format("page-cache prewarm"),
    "VLLM_PLE_MMAP_MADVISE": _PLE_ENGINE.format("madvise advice"),
    "VLLM_PLE_MMAP_FAST_ROWS": _PLE_ENGINE.format("inline-read threshold"),
    "VLLM_PLE_MMAP_STATS_SEC": _PLE_ENGINE.format("stats log interval"),
    "VLLM_PLE_MMAP_PROMETHEUS": _PLE_ENGINE.format("Prometheus export"),
    "VLLM_PLE_MMAP_RING_DEPTH": _PLE_ENGINE.format("io_uring depth"),
    "VLLM_PLE_MMAP_CHUNK": _PLE_ENGINE.format("rows per pool task"),
    "VLLM_PLE_MMAP_IO": _PLE_ENGINE.format("I/O method"),
    "VLLM_PLE_MMAP_NATIVE": _PLE_ENGINE.format("compiled (numba) gather loops"),
    "VLLM_PLE_MMAP_DEDUP_MIN": _PLE_ENGINE.format("Stager dedup threshold (its own small CUDA graphs are "
                                                  "captured by the Stager, not by torch.compile)"),
}


def traced_env() -> frozenset[str]:
    """Every variable some patch's traced-code state reads."""
    return frozenset(v for _, names in TRACED.values() for v in names)


def knobs(applied: Iterable[int], env: Mapping[str, str]) -> dict[str, dict]:
    return {str(n): TRACED[n][0](env) for n in sorted(set(applied)) if n in TRACED}


def _package_files() -> list[tuple[str, Path]]:
    here = Path(__file__).resolve().parent
    top = here.parent
    files = sorted(list(here.rglob("*.py")) + list((top / "flash_common").glob("*.py")))
    return [(f.relative_to(top).as_posix(), f) for f in files]


@functools.cache
def source_hash() -> str:
    """The plugin's own source: relative path and bytes of every module (line endings folded)."""
    h = hashlib.sha256()
    for rel, f in _package_files():
        h.update(rel.encode() + b"\0" + f.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()[:16]


def signature(base: str, applied: Iterable[int], env: Mapping[str, str]) -> dict[str, Any]:
    return {"v": VERSION, "base": base, "applied": sorted(set(applied)), "knobs": knobs(applied, env),
            "source": source_hash()}


def key_of(sig: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(sig, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def mix(vllm_hash: str, key: str) -> str:
    """vLLM's hash combined with ours, at vLLM's length (it names directories with it)."""
    return hashlib.sha256(f"{vllm_hash}:flash:{key}".encode()).hexdigest()[:len(vllm_hash)]


_state: dict[str, str] = {}


def current() -> str | None:
    return _state.get("key")


def _make(orig: Callable[..., str]) -> Callable[..., str]:
    @functools.wraps(orig)
    def compute_hash(self, *args, **kwargs):
        h = orig(self, *args, **kwargs)
        key = _state.get("key")
        return mix(h, key) if key else h

    return compute_hash


def check() -> None:
    _, _, value = resolve(*TARGET)
    if not callable(value):
        raise TargetMissing(f"{':'.join(TARGET)} is not a method")


def verify() -> None:
    _, _, value = resolve(*TARGET)
    if not is_ours(value, MARK):
        raise TargetMissing(f"{':'.join(TARGET)} is not the flash compile-key wrap")


def install(ctx: Context, applied: Iterable[int]) -> dict[str, Any]:
    """Set this process's key and wrap `VllmConfig.compute_hash` (once). Returns the signature
    with its `key`. Raises TargetMissing when the target is gone."""
    sig = signature(ctx.base.name, applied, ctx.env)
    key = key_of(sig)
    check()
    _install(MARK, *TARGET, _make)
    verify()
    _state["key"] = key
    log.info("flash_vllm: compile-cache key %s (vLLM's config hash is mixed with it: patches [%s], traced "
             "knobs %s, plugin source %s)", key, ",".join(map(str, sig["applied"])),
             json.dumps(sig["knobs"], sort_keys=True, separators=(",", ":")), sig["source"])
    return {**sig, "key": key}
