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


def with_release(text: str, version: str = "0.34.0", alias: str = "0.33.0", current: bool = True) -> str:
    """releases.py's `text` with one more entry, `version`, holding `alias`'s pins and capabilities
    (what a release that changes nothing we depend on looks like), made CURRENT when asked: the
    edit a real addition makes by hand."""
    import re

    old = releases.by_version(alias)
    major, minor, _ = version.split(".")
    caps = ", ".join(f"{k}={v!r}" for k, v in old.caps.items())
    entry = f'    Release(base="v{major}.{minor}", version="{version}", image="vllm/vllm-openai:v{version}", ' \
            f'digest=None, torch="{old.torch}", caps=dict({caps})),\n'
    start = text.index("RELEASES: tuple[Release, ...] = (")
    end = text.index("\n)\n", start)
    text = text[:end + 1] + entry + text[end + 1:]
    if current:
        text, n = re.subn(r'^CURRENT = "[^"]+"', f'CURRENT = "v{major}.{minor}"', text, flags=re.M)
        assert n == 1
    return text


def fake_catalogue(root, version: str = "0.34.0", alias: str = "0.33.0", current: bool = True):
    """A copy of flash_common under `root` whose catalogue has one more release (`with_release`).
    The copy differs from the real package in releases.py alone: put `root` first on PYTHONPATH
    and every reader (settings, profiles, run spec, registry, docs generator, compat) sees the new
    release with no other edit."""
    import shutil
    from pathlib import Path

    src = Path(releases.__file__).resolve().parent
    dest = Path(root) / "flash_common"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    path = dest / "releases.py"
    path.write_text(with_release(path.read_text(), version, alias, current))
    return Path(root)
