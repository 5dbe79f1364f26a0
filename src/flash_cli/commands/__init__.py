"""The command modules. Each exposes `register(subparsers)` and sets `func` on its parser(s).

Adding a command = one module here + its name in COMMANDS. Modules must stay light at import
time (heavy libraries are imported inside the functions) because every `flash` run imports all
of them to build the parser.
"""

from __future__ import annotations

import importlib
from types import ModuleType

COMMANDS: tuple[str, ...] = (
    "doctor",
    "setup",
    "serve",
    "wait",
    "status",
    "logs",
    "lifecycle",
    "profiles",
    "test",
)


def load(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")
