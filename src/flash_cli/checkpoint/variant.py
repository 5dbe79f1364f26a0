"""The one transaction that builds a served checkpoint variant next to its snapshot.

    partial → link → rewrite → index → gate → marker → swap

A builder (hybrid.py, graft.py) decides everything first and hands over a `Build`: what to link
unchanged, which configs to write, a `write(partial)` step that writes the rewritten shards, the
new index's weight map, a `gate(partial, written)` that lists problems, and the marker fields.
This module runs the steps in order in `<dest>.partial/` (an interrupted earlier one is never
trusted: it is removed first), writes `.prepared` only after the gate passed and the rewritten
files are durable, renames the result into place, and removes the partial directory on any
failure. It prints nothing: progress goes to the `progress` callback the command passes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from . import layout, marker
from .layout import CheckpointError

PARTIAL = ".partial"
DISK_MARGIN = 512 * 1024 * 1024
CONFIG_MODE = 0o644


@dataclass
class Build:
    kind: str                                  # "hybrid" | "hybrid-mtp" (hfcache.VARIANTS)
    what: str                                  # for messages: "hybrid", "graft"
    source: Path                               # the snapshot the marker records
    dest: Path                                 # the variant directory
    links: list[tuple[Path, str]]              # (file, name in the variant), linked unchanged
    configs: Mapping[str, dict]                # name -> JSON written as a real file
    rewritten: list[str]                       # shard names `write` produces (fsynced before the marker)
    weight_map: dict[str, str]                 # the variant's index
    index_metadata: dict
    write: Callable[[Path], Any]               # writes the rewritten shards into the partial dir
    gate: Callable[[Path, Any], list[str]]     # problems with the built partial dir (written = write's result)
    marker: Callable[[Any], dict]              # marker fields, from write's result
    bytes_needed: int = 0
    bytes_free: int | None = None              # None: not checked
    gate_message: str = ""                     # "<gate_message>: <first problem>" (default: the built <what> failed verification)
    extra: dict = field(default_factory=dict)


def check_disk(b: Build) -> None:
    if b.bytes_free is not None and b.bytes_needed + DISK_MARGIN > b.bytes_free:
        raise CheckpointError(f"not enough disk for the {b.what}: need {b.bytes_needed / 1e9:.2f} GB "
                              f"(+{DISK_MARGIN / 1e9:.1f} GB margin), {b.bytes_free / 1e9:.2f} GB free on {b.dest.parent}",
                              hint="free space there, or move HF_CACHE")


def build(b: Build) -> dict:
    """Run the transaction. Returns the marker's data; on any failure nothing is left behind."""
    dest = Path(b.dest)
    partial = dest.with_name(dest.name + PARTIAL)
    if partial.exists():
        shutil.rmtree(partial)  # an interrupted earlier run: never trusted, rebuilt
    check_disk(b)
    partial.mkdir()
    try:
        for src, name in b.links:
            layout.link_relative(src, partial / name)
        for name, data in b.configs.items():
            layout.write_json_atomic(partial / name, data)
            os.chmod(partial / name, CONFIG_MODE)
        written = b.write(partial)
        write_index(partial, b.weight_map, b.index_metadata)
        problems = b.gate(partial, written)
        if problems:
            raise CheckpointError(f"{b.gate_message or f'the built {b.what} failed verification'}: {problems[0]}"
                                  + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        for name in b.rewritten:  # durable before the marker claims them
            fd = os.open(partial / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        data = marker.write(partial, b.kind, b.source, **b.marker(written))
        layout.fsync_dir(partial)
        swap_into_place(partial, dest)
        return data
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def write_index(directory: Path, weight_map: dict[str, str], metadata: dict) -> None:
    """The variant's `model.safetensors.index.json`; total_size from the files as built/linked."""
    meta = dict(metadata)
    meta["total_size"] = sum((directory / f).stat().st_size for f in set(weight_map.values()))
    layout.write_json_atomic(directory / layout.INDEX, {"metadata": meta, "weight_map": weight_map})
    os.chmod(directory / layout.INDEX, CONFIG_MODE)


def swap_into_place(partial: Path, dest: Path) -> None:
    """Rename the verified partial directory over the variant (the old one goes aside first)."""
    old = dest.with_name(dest.name + ".old")
    if dest.exists() or dest.is_symlink():
        if old.exists():
            shutil.rmtree(old)
        os.rename(dest, old)
    os.rename(partial, dest)
    layout.fsync_dir(dest.parent)
    # Also the .old a process killed between the two renames left behind (a whole variant's
    # rewritten shards: gigabytes nobody would otherwise reclaim).
    shutil.rmtree(old, ignore_errors=True)
