"""What the gpu-e2e servers' own sitecustomize files (breaker/, inject/) share: running the next
one, and finding the spec the other import finders would return for a module they intercept.

Python runs only the first sitecustomize.py on sys.path; ours sit first (fleet.render puts their
directories ahead), so each hands over to the next one after its own directory, as if it were not
there: the payload's or a venv's. Strictly forward, so two of ours on one path (a breaker and an
injection in one server) run once each, never each other in a loop. This directory is on every
server's PYTHONPATH (fleet.HARNESS_SITE).
"""

from __future__ import annotations

import importlib.util
import os
import sys


def chain_next(own_file: str) -> str | None:
    """Execute the first sitecustomize.py on sys.path after own_file's directory; its path, or None."""
    here = os.path.dirname(os.path.abspath(own_file))
    entries = [os.path.abspath(e) if e else "" for e in sys.path]
    after = entries[entries.index(here) + 1:] if here in entries else entries
    for entry in after:
        if not entry or entry == here:
            continue
        cand = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(cand):
            spec = importlib.util.spec_from_file_location(f"_sitecustomize_after_{len(after)}", cand)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return cand
    return None


def next_spec(me, fullname, path=None, target=None):
    """The spec every finder on sys.meta_path but `me` would return for fullname (None: none)."""
    for finder in sys.meta_path:
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None
