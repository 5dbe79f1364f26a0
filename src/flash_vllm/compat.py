"""Which vLLM release line this process runs on. The only module that looks at versions.

Policy (style rule 10): the base is decided once, here, before any patch is touched; patches
declare the bases they apply to and never compare versions themselves.

The releases themselves (bases, pinned versions, capabilities) are `flash_common.releases`, the
catalogue both wings read; this module only decides which of them the running process is.

- The image bakes `FLASH_VLLM_BASE` (Dockerfile `ENV`). When set, it must be one of BASES and
  must agree with the installed vLLM's release line: a v0.29 label on a 0.33 install is a broken
  image, not something to guess around.
- Without it (a venv, the verification tier) the base follows from the installed version.
- A development build (`0.1.devN+g…`) cannot be ordered: it needs `FLASH_VLLM_BASE`.
- A release newer than the newest known base is refused at runtime; `selfcheck --assume-base`
  and `tools/check_vllm_release.py` evaluate it against the newest base's expectations, which is
  how a new release gets checked the day it appears.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from flash_common import releases

BASE_ENV = "FLASH_VLLM_BASE"

# Release line -> the exact release the Dockerfiles and the verification tier pin (from the catalogue).
BASES: dict[str, str] = {r.base: r.version for r in releases.RELEASES}
NEWEST = releases.NEWEST
ORDER = releases.ORDER  # oldest first


class CompatError(RuntimeError):
    """The installed vLLM and the requested base do not fit together."""


@dataclass(frozen=True)
class Base:
    name: str            # "v0.30"
    vllm_version: str    # what is installed, e.g. "0.30.0" (or a dev build string)
    source: str          # "env" | "version" | "assumed"
    provisional: bool = False  # a newer release checked against the newest known base

    def at_least(self, other: str) -> bool:
        return ORDER.index(self.name) >= ORDER.index(other)


_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?(?:\+.*)?$")


def line_of(version: str) -> str | None:
    """`0.30.1` -> `v0.30`; a dev build or garbage -> None."""
    m = _RELEASE.match(version.strip())
    if not m or ".dev" in version:
        return None
    return f"v{m.group(1)}.{m.group(2)}"


def _key(line: str) -> tuple[int, int]:
    major, minor = line[1:].split(".")
    return int(major), int(minor)


def resolve(vllm_version: str, env: Mapping[str, str], assume: str | None = None) -> Base:
    """Decide the base for this process. Raises CompatError with the fix in the message."""
    baked = env.get(BASE_ENV, "").strip()
    line = line_of(vllm_version)
    if assume:
        if assume not in BASES:
            raise CompatError(f"unknown base {assume!r}; known: {', '.join(ORDER)}")
        return Base(assume, vllm_version, "assumed", provisional=line != assume)
    if baked:
        if baked not in BASES:
            raise CompatError(
                f"{BASE_ENV}={baked!r} is not a supported base; known: {', '.join(ORDER)}")
        if line is not None and line != baked:
            raise CompatError(
                f"{BASE_ENV}={baked} but vLLM {vllm_version} is installed (line {line}); "
                f"rebuild the image from the Dockerfile for {line} or fix the base label")
        return Base(baked, vllm_version, "env")
    if line is None:
        raise CompatError(
            f"vLLM {vllm_version!r} is a development build whose release line cannot be "
            f"told from its version; set {BASE_ENV} to one of {', '.join(ORDER)}")
    if line in BASES:
        return Base(line, vllm_version, "version")
    if _key(line) < _key(ORDER[0]):
        raise CompatError(
            f"vLLM {vllm_version} predates {ORDER[0]} (the first release with qwen4_exp); "
            f"supported: {', '.join(ORDER)}")
    raise CompatError(
        f"vLLM {vllm_version} is newer than the newest verified base {NEWEST}; run "
        f"`tools/check_vllm_release.py {vllm_version} --propose` and add the entry to flash_common.releases")


def installed_vllm_version() -> str:
    """The installed vLLM's version, from its distribution metadata (imports nothing)."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise CompatError("vLLM is not installed in this Python environment") from None


def base_for_release(version: str) -> str:
    """What `tools/check_vllm_release.py` evaluates a release against (newest base if newer)."""
    line = line_of(version)
    if line is None:
        raise CompatError(f"{version!r} is not a release version (X.Y.Z)")
    if line in BASES:
        return line
    if _key(line) < _key(ORDER[0]):
        raise CompatError(f"vLLM {version} predates {ORDER[0]}; supported: {', '.join(ORDER)}")
    return NEWEST
