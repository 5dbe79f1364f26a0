"""Shared fixtures: tests never touch the user's state (HOME, XDG dirs, HF cache are tmp)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def isolate_state(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    for var in ("XDG_STATE_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("FLASH_DEBUG", raising=False)
    yield home
