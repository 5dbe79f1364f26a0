"""Test helpers over the release catalogue (flash_common.releases): change one capability of
one catalogued release for the length of a test (monkeypatch undoes it)."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from flash_common import releases


def with_cap(monkeypatch, base: str, **caps: object) -> releases.Release:
    """`base`'s entry with `caps` replaced, as every reader of `releases.get`/`cap`/`has` sees it."""
    old = releases.get(base)
    new = dataclasses.replace(old, caps={**old.caps, **caps})
    by_base = dict(releases.BY_BASE)
    by_base[base] = new
    monkeypatch.setattr(releases, "BY_BASE", MappingProxyType(by_base))
    return new
