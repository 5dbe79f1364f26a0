"""Profiles: `profiles/<name>.env`, plain KEY=VALUE lines plus `# desc:` / `# base:` metadata.

Stricter than the upstream loader: keys must be in the settings table (did-you-mean on a typo),
whitespace around `=` is trimmed, matching single or double quotes are stripped, and `# base:`
becomes the BASE setting so the profile picks its image line (`# base: current` = the release
catalogue's current base, `flash_common.releases.CURRENT`: moving it moves those profiles).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

from flash_common import releases

from .errors import ConfigError, UsageError
from .settings import BY_NAME, lookup

REPO = Path(__file__).resolve().parents[2]
PROFILES_DIR = REPO / "profiles"
_META = re.compile(r"#\s*(desc|base)\s*:\s*(.*)$")


@dataclass(frozen=True)
class Profile:
    name: str
    path: Path
    desc: str = ""
    base: str = ""
    values: dict[str, str] = field(default_factory=dict)

    def layer(self) -> dict[str, str]:
        """The settings layer this profile contributes (`# base:` included as BASE)."""
        out = dict(self.values)
        if self.base and "BASE" not in out:
            out["BASE"] = self.base
        return out


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def parse(text: str, name: str, path: Path) -> Profile:
    desc, base, values = "", "", {}
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            m = _META.match(stripped)
            if m and m.group(1) == "desc":
                desc = m.group(2).strip()
            elif m:
                base = m.group(2).strip()
            continue
        key, sep, value = stripped.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{path}:{lineno}: expected KEY=VALUE, got {stripped!r}")
        lookup(key, f"{path.name}:{lineno}")
        values[key] = _unquote(value.strip())
    if base == "current":
        base = releases.CURRENT
    if base:
        BY_NAME["BASE"].parse(base)  # `# base:` is validated like the setting it feeds
    return Profile(name=name, path=path, desc=desc, base=base, values=values)


def names(directory: Path = PROFILES_DIR) -> list[str]:
    found = sorted(p.stem for p in directory.glob("*.env"))
    return (["default"] if "default" in found else []) + [n for n in found if n != "default"]


def load(name: str, directory: Path = PROFILES_DIR) -> Profile:
    path = directory / f"{name}.env"
    if not re.fullmatch(r"[\w.-]+", name) or not path.is_file():
        known = names(directory)
        guess = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        available = ", ".join(known) or "(none)"
        raise UsageError(f"unknown profile {name!r}" + (f": did you mean {guess[0]!r}?" if guess else ""),
                         hint=f"profiles: {available} (see: flash profiles)")
    return parse(path.read_text(encoding="utf-8"), name, path)


_B12X = re.compile(r"^#\s*b12x:\s*(?P<item>.+?):\s+(?P<why>.+)$")


def b12x_items(path: Path) -> dict[str, str]:
    """{recipe item: why it is left out} from a profile's `# b12x: ITEM: why` lines: what NVIDIA's
    recipe (its B12x image) has that our base does not (profiles/nvidia.env, nvidia-tp2.env)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _B12X.match(line.strip())
        if m:
            out[m.group("item")] = m.group("why")
    return out
