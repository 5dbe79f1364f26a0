"""Index helpers and the selection of the tensors the fp8 hybrid converts.

Everything is resolved through `model.safetensors.index.json` and each file's header, never
from file-name patterns: RadixArk (`model-bf16-*`, `model-plefp8-*`, `layer-*-experts-*`) and
nvidia (`model-000NN-of-00010`, `model-fp8-mtp-ple`) go through the same code.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import FlashError

INDEX = "model.safetensors.index.json"

# docs/decisions/hybrid-convention.md: the 300 side layers + the 12 QSA indexer projections
# (vLLM ≥ 0.32 packs indexer.index_qk_proj into qkv_proj, so it must share q/k/v's format).
SIDE_LAYER = re.compile(
    r"model\.language_model\.layers\.\d+\."
    r"(?:linear_attn\.(?:in_proj_qkv|in_proj_z|out_proj)"
    r"|self_attn\.(?:q_proj|k_proj|v_proj|o_proj|indexer\.index_qk_proj)"
    r"|mlp\.shared_expert\.(?:gate_proj|up_proj|down_proj))\.weight"
)
SCALE_SUFFIX = "_scale"  # X.weight → X.weight_scale (ModelOpt FP8_PB_WO, 4-D [N/128,1,K/128,1])
OLD_SCALE_SUFFIX = "_scale_inv"  # the format-1 (dispatch-2d) hybrids: refused as a source


class CheckpointError(FlashError):
    """A checkpoint that cannot be used as it is (details in the message)."""

    exit_code = 1


def load_index(directory: Path) -> dict:
    """The index JSON (metadata + weight_map), with a clear error when it is not usable."""
    from flash_common.stheader import HeaderError, read_index

    path = Path(directory) / INDEX
    try:
        read_index(directory)  # bounded, strict validation (size cap, str→str map)
        data = json.loads(path.read_text())
    except HeaderError as exc:
        raise CheckpointError(f"unusable index: {exc}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unusable index {path}: {exc}") from None
    if not isinstance(data.get("metadata", {}), dict):
        raise CheckpointError(f"{path}: metadata is not an object")
    return data


def files_of(weight_map: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
        out.setdefault(fname, []).append(key)
    return out


def safe_name(fname: str) -> bool:
    """An index file entry must name a file inside the snapshot, not a path out of it."""
    return bool(fname) and "/" not in fname and "\\" not in fname and fname not in (".", "..") \
        and not fname.startswith(".")


def write_json_atomic(path: Path, obj, indent: int | None = 2) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def link_relative(target: Path, link: Path) -> None:
    """Symlink `link` → the file `target` resolves to, relative (cache layout stays movable)."""
    real = os.path.realpath(target)
    os.symlink(os.path.relpath(real, os.path.dirname(os.path.abspath(link))), link)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
