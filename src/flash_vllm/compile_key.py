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
  (the patch's `traced` variables through its `knobs()`), normalised (unset and the default are
  the same state);
- `source`: a hash of the plugin's own source (`flash_vllm/**/*.py`, `flash_common/*.py`), so a
  new flash version never reuses an old artifact.

Everything else is left out on purpose (each patch's `untraced` says why for each other variable
it reads): ports, paths, worker counts and I/O tuning do not change the traced code, and hashing
them would recompile on every boot that moves them. The unit tier fails when a patch's folder
reads a variable its Patch declares neither traced nor untraced.

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

from .registry import (DISABLE_ENV, UNTRACED_GATE, Context, TargetMissing, catalogue, install as _install,
                       is_ours, resolve)

log = logging.getLogger("vllm.flash")

TARGET = ("vllm.config.vllm", "VllmConfig.compute_hash")
MARK = 0  # the registry's replacement mark; 0: not a numbered patch (patches count from 1)
VERSION = 1  # of the signature's layout


# The registry's kill switch is read by no patch; every other variable is declared on its patch.
REGISTRY_UNTRACED: dict[str, str] = {DISABLE_ENV: UNTRACED_GATE}


def traced() -> dict[int, tuple[str, ...]]:
    """Patch number -> the variables whose value changes the code torch.compile traces (each
    patch's `traced`)."""
    return {p.number: p.traced for p in catalogue() if p.traced}


def untraced() -> dict[str, str]:
    """Every other variable the patches read -> why the key leaves it out (each patch's `untraced`,
    plus the registry's kill switch). Patches sharing a variable give one reason; the first wins."""
    out = dict(REGISTRY_UNTRACED)
    for p in catalogue():
        for name, why in p.untraced.items():
            out.setdefault(name, why)
    return out


def traced_env() -> frozenset[str]:
    """Every variable some patch's traced-code state reads."""
    return frozenset(v for names in traced().values() for v in names)


def knobs(applied: Iterable[int], env: Mapping[str, str]) -> dict[str, dict]:
    by_number = {p.number: p for p in catalogue()}
    return {str(n): by_number[n].knobs(env) for n in sorted(set(applied))
            if n in by_number and by_number[n].knobs is not None}


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
