"""Output conventions: results on stdout, progress/hints on stderr, colour only on a TTY."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO


def _colour(stream: TextIO) -> bool:
    return stream.isatty() and os.environ.get("NO_COLOR") is None and os.environ.get("TERM") != "dumb"


def _paint(code: str, text: str, stream: TextIO) -> str:
    return f"\033[{code}m{text}\033[0m" if _colour(stream) else text


class Report:
    """Collects ok/warn/fail/info lines (doctor, setup, status) and counts problems."""

    def __init__(self, stream: TextIO | None = None, quiet: bool = False):
        self.stream = stream or sys.stdout
        self.quiet = quiet
        self.items: list[dict[str, str]] = []
        self.failures = 0
        self.warnings = 0

    def _line(self, status: str, mark: str, code: str, text: str, section: str | None) -> None:
        self.items.append({"status": status, "text": text, "section": section or ""})
        if not self.quiet:
            print(f"  {_paint(code, mark, self.stream)} {text}", file=self.stream)

    def ok(self, text: str, section: str | None = None) -> None:
        self._line("ok", "✔", "32", text, section)

    def warn(self, text: str, section: str | None = None) -> None:
        self.warnings += 1
        self._line("warn", "!", "33", text, section)

    def fail(self, text: str, section: str | None = None) -> None:
        self.failures += 1
        self._line("fail", "✘", "31", text, section)

    def info(self, text: str, section: str | None = None) -> None:
        self._line("info", "·", "2", text, section)

    def step(self, title: str) -> None:
        if not self.quiet:
            print(f"\n{_paint('2', '>> ' + title, self.stream)}", file=self.stream)


def say(text: str) -> None:
    """Progress and hints: stderr, so stdout stays parseable."""
    print(text, file=sys.stderr)


def dim(text: str, stream: TextIO | None = None) -> str:
    return _paint("2", text, stream or sys.stderr)


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))
