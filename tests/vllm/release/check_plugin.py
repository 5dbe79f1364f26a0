"""The plugin on a real release: registers through vLLM's loader, idempotent, loud on a missing target."""

from __future__ import annotations

import logging
import sys

import pytest

from flash_vllm import plugin
from flash_vllm.registry import catalogue, resolve


def test_register_applies_every_enabled_patch_for_this_base(registered, base, gates):
    expected = [p.number for p in catalogue() if p.meant_for(base) and p.enabled(gates)]
    assert registered["base"] == base
    assert registered["applied"] == expected
    assert len(expected) >= 6  # 2 4 5 8 10 + base-specific ones


def test_register_is_idempotent(registered, gates):
    again = plugin.register(env=gates)
    assert again is registered
    # apply() a second time, bypassing the process guard: targets stay the same objects
    from flash_vllm.registry import Context
    from flash_vllm import compat

    ctx = Context(compat.resolve(registered["vllm"], {}), gates)
    before = {}
    for p in catalogue():
        if p.number in registered["applied"]:
            before[p.number] = [_current(t) for t in p.targets if ":" in t and " " not in t]
            p.apply(ctx)
            p.verify(ctx)
            assert [_current(t) for t in p.targets if ":" in t and " " not in t] == before[p.number]


def _current(target: str):
    module, qual = target.split(":")
    return resolve(module, qual)[2]


def test_vllm_plugin_loader_calls_register(registered, tmp_path, monkeypatch):
    """vLLM's own `load_general_plugins()` finds the `flash` entry point and runs register()."""
    dist = tmp_path / "flash_recipe-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-recipe\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nflash = flash_vllm:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    import vllm.plugins as vp

    called = []
    monkeypatch.setattr(plugin, "register", lambda *a, **k: called.append(1) or registered)
    monkeypatch.setattr(vp, "plugins_loaded", False, raising=False)
    vp.load_general_plugins()
    assert called == [1]


def test_missing_target_stops_register(gates, monkeypatch, registered):
    """A renamed upstream symbol raises inside register() (vLLM only logs import errors)."""
    from vllm.v1.core.sched import scheduler

    monkeypatch.delattr(scheduler.Scheduler, "_mamba_block_aligned_split")
    plugin.reset_for_tests()
    try:
        with pytest.raises(plugin.PatchFailed, match=r"patch 4 \(mamba-block-size\)"):
            plugin.register(env=gates)
    finally:
        plugin._state["summary"] = registered


def test_stale_from_import_bindings_are_rebound(registered):
    """Modules that did `from x import f` before the patch see our replacement (style rule 11)."""
    import types

    from flash_vllm.registry import expect_installed, rebind_stale
    import vllm.third_party.flash_linear_attention.ops.utils as u

    patched = u.check_shared_mem
    assert patched.__flash_patch__ == 2
    early = types.ModuleType("vllm._flash_test_early_importer")
    early.check_shared_mem = patched.__flash_original__  # bound before flash_vllm registered
    sys.modules[early.__name__] = early
    try:
        with pytest.raises(Exception, match="stale bindings"):
            expect_installed(2, u.__name__, "check_shared_mem")
        assert rebind_stale(patched.__flash_original__, patched) == [f"{early.__name__}.check_shared_mem"]
        assert early.check_shared_mem is patched
        expect_installed(2, u.__name__, "check_shared_mem")
    finally:
        del sys.modules[early.__name__]
    # the real consumers imported it by name
    from vllm.third_party.flash_linear_attention.ops import chunk_o, cumsum

    assert chunk_o.check_shared_mem is patched and cumsum.check_shared_mem is patched


def test_banner_names_base_and_patches(gates, registered, caplog):
    plugin.reset_for_tests()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.flash")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        plugin.register(env=gates)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    msg = [r.getMessage() for r in records if "flash_vllm: base" in r.getMessage()]
    assert msg and registered["base"] in msg[0] and "applied [" in msg[0]
