"""`register()`: what vLLM's general-plugin loader calls in every process.

vLLM only *logs* an exception raised while importing a plugin, so this module and the package
import nothing heavy; everything happens inside `register()`, where an exception propagates and
stops the process. An enabled patch whose target is missing therefore stops the server at boot
with the patch named, instead of serving unpatched.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Mapping

from . import compat, compile_key
from .registry import Context, Patch, TargetMissing, catalogue

# vLLM configures the "vllm" logger; a child logger shares its handlers and format.
log = logging.getLogger("vllm.flash")

_lock = threading.Lock()
_state: dict[str, object] = {}


class PatchFailed(RuntimeError):
    """An enabled patch could not be applied on this base."""


def plan(ctx: Context) -> list[tuple[Patch, str]]:
    """(patch, action) for every patch: apply / off (gate) / upstream / not-needed / not-ported."""
    out = []
    for p in catalogue():
        status = p.expected_status(ctx.base.name)
        if status == "applies":
            out.append((p, "apply" if p.enabled(ctx.env) else "off"))
        else:
            out.append((p, status))
    return out


def register(env: Mapping[str, str] | None = None, vllm_version: str | None = None) -> dict:
    """Apply every enabled patch for this base. Idempotent; raises on a missing target."""
    with _lock:
        if "summary" in _state:
            return _state["summary"]  # type: ignore[return-value]
        env = dict(os.environ) if env is None else dict(env)
        version = vllm_version or compat.installed_vllm_version()
        ctx = Context(compat.resolve(version, env), env)
        applied, skipped = [], []
        for patch, action in plan(ctx):
            if action != "apply":
                skipped.append(f"{patch.number}:{action}")
                continue
            try:
                patch.check(ctx)
                patch.apply(ctx)
                patch.verify(ctx)
            except TargetMissing as e:
                raise PatchFailed(
                    f"flash_vllm patch {patch.number} ({patch.name}) cannot apply on "
                    f"{ctx.base.name} (vLLM {version}): {e}") from e
            applied.append(patch.number)
        # Not a numbered patch (always on): vLLM's compile-cache key learns this process's patch
        # state, so a persistent cache never hands one patch state the graph traced with another.
        try:
            key = compile_key.install(ctx, applied)["key"]
        except TargetMissing as e:
            raise PatchFailed(f"flash_vllm compile-cache key cannot hook {':'.join(compile_key.TARGET)} on "
                              f"{ctx.base.name} (vLLM {version}): {e}") from e
        summary = {"base": ctx.base.name, "vllm": version, "applied": applied, "skipped": skipped,
                   "compile_key": key}
        _state["summary"] = summary
        # The banner `flash status`/`logs` look for: one line, every patch accounted for.
        log.info("flash_vllm: base %s (vLLM %s), pid %d, applied [%s], not applied [%s]",
                 ctx.base.name, version, os.getpid(), ",".join(map(str, applied)),
                 ",".join(skipped))
        return summary


def reset_for_tests() -> None:
    _state.clear()
