"""The patch registry: every patch is a declared unit, and the machinery that installs them.

A `Patch` carries its metadata (number, name, why, the bases it ships code for, the upstream PR
or issue that makes it unnecessary and the bases where that fix is already in), its env gate,
and three functions:

- `check(ctx)`: the target still looks as expected (module, attribute, the source anchors the
  patch relies on). Raises `TargetMissing`. Needs no gate and changes nothing.
- `apply(ctx)`: installs the patch through `install()`. Applying twice is a no-op.
- `verify(ctx)`: after apply, every target (and every stale `from x import y` binding) points to
  our replacement.

`upstream_check(ctx)`, where given, proves the upstream fix is present on the bases listed in
`upstream_in` (so "upstream" in the matrix is read from the release, not assumed).

What a patch means for the compile-cache key (flash_vllm/compile_key.py) is declared on it too:
`traced` names the env variables whose value changes the code torch.compile traces once the patch
is applied, and `knobs(env)` normalises them into the key; `untraced` says, per other variable the
patch reads, why the key leaves it out.

Each patch is a folder `patches/pNN_name/` (NN its number, name its `name` with `_` for `-`); the
package holds `PATCH`, its sibling modules the helpers and per-release variants. `catalogue()`
finds the folders; nothing lists them.

Nothing here imports vLLM; targets are imported lazily by the patch modules.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .compat import ORDER, Base

STATUSES = ("applies", "upstream", "not-needed", "not-ported", "broken")
TRUE = ("1", "true", "yes", "on")
DISABLE_ENV = "FLASH_DISABLE_PATCHES"  # comma list of patch numbers: an operator's kill switch
# Why a gate variable stays out of the compile key (a patch's `untraced` reason for its own gate).
UNTRACED_GATE = "a patch's on/off gate: whether it applies is in `applied`"


class Unclassified(RuntimeError):
    """A catalogued release that a patch leaves unclassified: the registry refuses to load."""


class TargetMissing(RuntimeError):
    """A patch target is gone or no longer looks like what the patch was written against."""


@dataclass(frozen=True)
class Context:
    base: Base
    env: Mapping[str, str]

    def flag(self, name: str) -> bool:
        return self.env.get(name, "").strip().lower() in TRUE


@dataclass(frozen=True)
class Gate:
    """When a patch is enabled at runtime. `env` names the variable the settings table sets."""

    env: str | None
    doc: str
    enabled: Callable[[Mapping[str, str]], bool] = lambda env: True

    @staticmethod
    def always(doc: str = "always on") -> "Gate":
        return Gate(None, doc)

    @staticmethod
    def flag(env: str, doc: str | None = None) -> "Gate":
        return Gate(env, doc or f"{env}=1", lambda e: e.get(env, "").strip().lower() in TRUE)


def _nothing(ctx: Context) -> None:
    return None


@dataclass(frozen=True)
class Patch:
    number: int
    name: str
    title: str
    why: str
    upstream: str                       # PR/issue (or capability) that makes it unnecessary
    gate: Gate
    targets: tuple[str, ...]            # "module:Qual.name" the patch touches or relies on
    applies_to: frozenset[str] = frozenset()   # bases we ship code for
    upstream_in: frozenset[str] = frozenset()  # bases where the fix is upstream
    not_ported: Mapping[str, str] = field(default_factory=dict)  # base -> why we ship nothing
    not_needed: frozenset[str] = frozenset()   # bases where the problem does not exist
    check: Callable[[Context], None] = _nothing
    apply: Callable[[Context], None] = _nothing
    verify: Callable[[Context], None] = _nothing
    upstream_check: Callable[[Context], None] | None = None
    notes: str = ""
    traced: tuple[str, ...] = ()        # env variables whose value changes the code torch.compile traces
    knobs: Callable[[Mapping[str, str]], dict] | None = None  # their normalised state, for the compile key
    untraced: Mapping[str, str] = field(default_factory=dict)  # other variables read -> why the key omits them

    def __post_init__(self) -> None:
        if bool(self.traced) != (self.knobs is not None):
            raise ValueError(f"patch {self.number}: `traced` and `knobs` come together (the variables and "
                             f"their normalised state)")
        both = set(self.traced) & set(self.untraced)
        if both:
            raise ValueError(f"patch {self.number}: {sorted(both)} both traced and untraced")

    @property
    def folder(self) -> str:
        """The package under flash_vllm/patches/ that holds this patch."""
        return folder_name(self.number, self.name)

    def meant_for(self, base: str) -> bool:
        return base in self.applies_to

    def expected_status(self, base: str) -> str:
        if base in self.applies_to:
            return "applies"
        if base in self.upstream_in:
            return "upstream"
        if base in self.not_ported:
            return "not-ported"
        if base in self.not_needed:
            return "not-needed"
        raise Unclassified(f"patch {self.number} ({self.name}) does not say what it does on {base}; classify it "
                           f"(applies_to / upstream_in / not_ported / not_needed, usually a range from "
                           f"flash_common.releases) before that release can be loaded")

    def enabled(self, env: Mapping[str, str]) -> bool:
        disabled = {s.strip() for s in env.get(DISABLE_ENV, "").split(",") if s.strip()}
        return str(self.number) not in disabled and self.gate.enabled(env)


# --- resolving and installing ------------------------------------------------------------

def import_target(module: str) -> types.ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TargetMissing(f"cannot import {module}: {e}") from e


def resolve(module: str, qualname: str) -> tuple[Any, str, Any]:
    """(owner, attribute, current value) for `module:Qual.name`, read statically."""
    owner: Any = import_target(module)
    parts = qualname.split(".")
    for part in parts[:-1]:
        try:
            owner = inspect.getattr_static(owner, part)
        except AttributeError:
            raise TargetMissing(f"{module}:{qualname}: {part!r} not found") from None
    try:
        value = inspect.getattr_static(owner, parts[-1])
    except AttributeError:
        raise TargetMissing(f"{module}:{qualname} not found") from None
    return owner, parts[-1], value


def original(value: Any) -> Any:
    """The upstream object under our replacement (itself when not ours)."""
    while getattr(value, "__flash_patch__", None) is not None:
        value = value.__flash_original__
    return value


def source_of(module: str, qualname: str) -> str:
    _, _, value = resolve(module, qualname)
    value = original(value)
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    try:
        return inspect.getsource(value)
    except (OSError, TypeError) as e:
        raise TargetMissing(f"{module}:{qualname}: source unavailable ({e})") from e


def expect_source(module: str, qualname: str, *anchors: str) -> str:
    """The target's source must still contain every anchor the patch relies on."""
    src = source_of(module, qualname)
    missing = [a for a in anchors if a not in src]
    if missing:
        raise TargetMissing(f"{module}:{qualname} no longer contains {missing!r}")
    return src


def expect_absent(module: str, qualname: str, *markers: str) -> None:
    src = source_of(module, qualname)
    present = [m for m in markers if m in src]
    if present:
        raise TargetMissing(f"{module}:{qualname} already contains {present!r} (fixed upstream?)")


def fingerprint(module: str, qualname: str) -> str:
    return hashlib.sha256(source_of(module, qualname).encode()).hexdigest()[:16]


def is_ours(value: Any, number: int) -> bool:
    return getattr(value, "__flash_patch__", None) == number


def install(number: int, module: str, qualname: str, make: Callable[[Any], Any]) -> Any:
    """Replace `module:qualname` with `make(current)`, once; rebind stale module-level names.

    Returns the installed replacement. Idempotent: when the target already carries our mark the
    existing replacement is returned and nothing changes.
    """
    owner, attr, current = resolve(module, qualname)
    if is_ours(current, number):
        return current
    unwrapped = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
    new = make(unwrapped)
    new.__flash_patch__ = number
    new.__flash_original__ = unwrapped
    if isinstance(current, staticmethod):
        setattr(owner, attr, staticmethod(new))
    elif isinstance(current, classmethod):
        setattr(owner, attr, classmethod(new))
    else:
        setattr(owner, attr, new)
    if isinstance(owner, types.ModuleType):
        rebind_stale(unwrapped, new)
    return new


def rebind_stale(old: Any, new: Any) -> list[str]:
    """Modules that did `from x import old` hold their own reference: point them to `new`."""
    hits = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("vllm"):
            continue
        d = getattr(mod, "__dict__", None)
        if not d:
            continue
        for key, val in list(d.items()):
            if val is old:
                setattr(mod, key, new)
                hits.append(f"{name}.{key}")
    return hits


def stale_bindings(old: Any) -> list[str]:
    return [f"{n}.{k}" for n, m in list(sys.modules.items()) if m is not None and n.startswith("vllm")
            for k, v in list(getattr(m, "__dict__", {}).items()) if v is old]


def expect_installed(number: int, module: str, qualname: str) -> None:
    _, _, current = resolve(module, qualname)
    if isinstance(current, (staticmethod, classmethod)):
        current = current.__func__
    if not is_ours(current, number):
        raise TargetMissing(f"patch {number}: {module}:{qualname} is not our replacement")
    stale = stale_bindings(current.__flash_original__)
    if stale:
        raise TargetMissing(f"patch {number}: stale bindings of {module}:{qualname}: {stale}")


def wraps(orig: Callable) -> Callable[[Callable], Callable]:
    return functools.wraps(orig)


# --- the catalogue -----------------------------------------------------------------------

FOLDER = re.compile(r"^p(\d{2})_([a-z0-9]+(?:_[a-z0-9]+)*)$")


def folder_name(number: int, name: str) -> str:
    return f"p{number:02d}_{name.replace('-', '_')}"


def folders() -> list[str]:
    """The patch folders under flash_vllm/patches/, in number order (read from disk, not a list)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent / "patches"
    found = sorted(d.name for d in here.iterdir() if (d / "__init__.py").is_file())
    odd = [d for d in found if not FOLDER.match(d)]
    if odd:
        raise RuntimeError(f"flash_vllm/patches/{odd[0]} is not a patch folder; patch folders are named "
                           f"pNN_name (NN the patch number, name the patch name with _ for -)")
    return found


def module_of(patch: Patch) -> types.ModuleType:
    """The package that declares `patch` (its docstring is the patch's long description)."""
    return importlib.import_module(f"{__package__}.patches.{patch.folder}")


@functools.cache
def catalogue() -> tuple[Patch, ...]:
    patches = []
    for folder in folders():
        mod = importlib.import_module(f"{__package__}.patches.{folder}")
        patch = getattr(mod, "PATCH", None)
        if not isinstance(patch, Patch):
            raise RuntimeError(f"flash_vllm/patches/{folder} has no PATCH (a flash_vllm.registry.Patch)")
        if patch.folder != folder:
            raise RuntimeError(f"flash_vllm/patches/{folder} declares patch {patch.number} ({patch.name}); "
                               f"its folder must be named {patch.folder}")
        patches.append(patch)
    numbers = [p.number for p in patches]
    if len(set(numbers)) != len(numbers):
        raise RuntimeError(f"duplicate patch numbers: {numbers}")
    for p in patches:
        classes = (p.applies_to, p.upstream_in, frozenset(p.not_ported), p.not_needed)
        unknown = frozenset().union(*classes) - set(ORDER)
        if unknown:
            raise RuntimeError(f"patch {p.number}: unknown bases {sorted(unknown)}")
        if sum(map(len, classes)) != len(frozenset().union(*classes)):
            raise RuntimeError(f"patch {p.number}: a base is in more than one of applies/upstream/not-ported/not-needed")
        for base in ORDER:
            p.expected_status(base)  # raises Unclassified: a new release must not silently drop a patch
    return tuple(patches)


def by_number(number: int) -> Patch:
    for p in catalogue():
        if p.number == number:
            return p
    raise KeyError(number)


def patchset_hash() -> str:
    """Identity of the patch set: metadata of every patch plus the source of its module.

    Labelled on the image (`org.flash.patchset`) so a container tells which patches it runs.
    The PLE engine package is not part of it (its own version travels with the wheel).
    """
    from pathlib import Path

    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    common = here.parent / "flash_common"
    files = sorted([here / "registry.py", here / "compat.py", here / "plugin.py", here / "compile_key.py",
                    common / "releases.py",
                    common / "effort.py"] + list((here / "patches").rglob("*.py")))
    for f in files:
        h.update(f.relative_to(here.parent).as_posix().encode() + b"\0")
        h.update(f.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()[:16]
