"""Golden files (tests/golden/): FLASH_UPDATE_GOLDEN=1 rewrites them; otherwise the text must match."""

from __future__ import annotations

import os
from pathlib import Path


def check(path: Path, text: str, missing: str, changed: str) -> None:
    """Assert `text` equals the golden file at `path` (messages: when it is missing, when it differs)."""
    if os.environ.get("FLASH_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), missing
    assert text == path.read_text(), changed
