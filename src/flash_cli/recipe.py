"""From command-line words to a resolved recipe: profile + settings + host facts.

`flash serve [PROFILE] [K=V…]`: when the first word contains `=`, the profile is `default`
and every word is an override (the upstream rule, kept).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from . import hfcache, profiles
from .settings import Settings, parse_assignments, resolve


@dataclass
class Recipe:
    profile: profiles.Profile
    settings: Settings

    @property
    def hf_cache(self) -> Path:
        return Path(os.path.expanduser(self.settings["HF_CACHE"]))

    def snapshot(self) -> Path | None:
        return hfcache.resolve_snapshot(self.hf_cache, self.settings["MODEL"], self.settings["REVISION"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="*", metavar="[PROFILE] [KEY=VALUE …]",
                        help="a profile name (default: default), then settings overrides")


def split_words(words: Sequence[str]) -> tuple[str, list[str], bool]:
    """→ (profile name, override words, whether the profile was named explicitly)."""
    if words and "=" not in words[0]:
        return words[0], list(words[1:]), True
    return "default", list(words), False


NO_PROFILE = profiles.Profile(name="(none)", path=profiles.PROFILES_DIR, desc="defaults + environment only")


def load(words: Sequence[str], env: Mapping[str, str] | None = None, use_profile: bool = True) -> Recipe:
    name, rest, _ = split_words(words)
    prof = profiles.load(name) if use_profile else NO_PROFILE
    overrides = parse_assignments(rest, "argument")
    settings = resolve(prof.layer(), os.environ if env is None else env, overrides, profile_name=prof.name)
    return Recipe(prof, settings)
