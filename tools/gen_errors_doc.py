#!/usr/bin/env python3
"""Regenerate the exit-code list in docs/ARCHITECTURE.md from the one error map,
src/flash_cli/errors.py: every FlashError class there, grouped by exit code, with the first line
of its docstring. `--check` exits 1 when the doc drifted from the code (a unit test runs it).

    .venv/bin/python tools/gen_errors_doc.py [--check]
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

from flash_cli import errors

DOC = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"
MARKERS = re.compile(r"(<!-- exit-codes:begin -->\n).*?(<!-- exit-codes:end -->)", re.S)


def error_classes() -> list[type[errors.FlashError]]:
    """FlashError and its subclasses defined in errors.py, in the order they are defined there."""
    found = [c for _, c in inspect.getmembers(errors, inspect.isclass)
             if issubclass(c, errors.FlashError) and c.__module__ == errors.__name__]
    return sorted(found, key=lambda c: inspect.getsourcelines(c)[1])


def meaning(cls: type) -> str:
    doc = inspect.getdoc(cls) if "__doc__" in vars(cls) and cls.__doc__ else None
    if not doc:
        raise SystemExit(f"src/flash_cli/errors.py: {cls.__name__} has no docstring; its first line is "
                         "what docs/ARCHITECTURE.md says the exit code means")
    return doc.splitlines()[0].rstrip(".")


def table() -> str:
    by_code: dict[int, list[type]] = {}
    for cls in error_classes():
        by_code.setdefault(cls.exit_code, []).append(cls)
    rows = ["| exit | error | meaning |", "|---|---|---|", "| 0 | | success |"]
    for code in sorted(by_code):
        for cls in by_code[code]:
            rows.append(f"| {code} | `{cls.__name__}` | {meaning(cls)} |")
    rows.append(f"| {errors.INTERRUPTED_EXIT} | | interrupted (Ctrl-C) |")
    return "\n".join(rows)


def render(text: str) -> str:
    if not MARKERS.search(text):
        raise SystemExit("docs/ARCHITECTURE.md lacks the <!-- exit-codes:begin/end --> markers")
    return MARKERS.sub(lambda m: m.group(1) + table() + "\n" + m.group(2), text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/ARCHITECTURE.md is out of date")
    args = ap.parse_args()
    old = DOC.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("docs/ARCHITECTURE.md's exit codes are out of date: run tools/gen_errors_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print("wrote docs/ARCHITECTURE.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
