"""`.prepared`: the JSON marker written last into a variant, then renamed into place with it."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from .. import __version__
from ..hfcache import MARKER, VARIANT_FORMAT


def write(directory: Path, mode: str, source: Path, **fields) -> dict:
    data = {
        "kind": mode,
        "format": VARIANT_FORMAT[mode],
        "source_revision": Path(source).name,
        "tool": f"flash {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_id": uuid.uuid4().hex,  # what a variant built on top records (timestamps repeat)
        **fields,
    }
    path = Path(directory) / MARKER
    tmp = path.with_name(MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return data
