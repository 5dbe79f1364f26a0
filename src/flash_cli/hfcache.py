"""The Hugging Face cache as flash reads it: repo dir, snapshot choice, completeness, variants.

Pure filesystem + json, no huggingface_hub import, so `serve --dry-run`, `doctor` and `setup`
can call it cheaply. Layout: `<HF_CACHE>/hub/models--org--name/{refs/main, blobs/<sha>,
snapshots/<rev>/<file> -> ../../blobs/<sha>}`. Prepared variants are siblings of the snapshot
inside `snapshots/`: `<rev>-fp8hybrid` and `<rev>-fp8hybrid-mtpnvfp4`, each with a `.prepared`
JSON marker written last (see flash_cli.checkpoint.marker).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ESSENTIAL = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "model.safetensors.index.json",
)
INDEX = "model.safetensors.index.json"
QUANT_FILE = "hf_quant_config.json"
MARKER = ".prepared"
VARIANT_SUFFIX = {"nvfp4": "", "hybrid": "-fp8hybrid", "hybrid-mtp": "-fp8hybrid-mtpnvfp4"}
# Bumped when the layout a step writes changes; a marker with another value is stale.
VARIANT_FORMAT = {"hybrid": 2, "hybrid-mtp": 2}  # 2: FP8_PB_WO + MIXED_PRECISION configs (was dispatch-2d)
_REV = re.compile(r"[0-9a-f]{40}")


def cache_root(hf_cache: str | Path) -> Path:
    return Path(hf_cache).expanduser()


def repo_dir(hf_cache: str | Path, model: str) -> Path:
    """`<cache>/hub/models--org--name` (huggingface_hub's own folder naming)."""
    return cache_root(hf_cache) / "hub" / ("models--" + model.replace("/", "--"))


def _read_ref(repo: Path, name: str) -> str | None:
    try:
        text = (repo / "refs" / name).read_text().strip()
    except OSError:
        return None
    return text or None


def is_variant_name(name: str) -> bool:
    return "-fp8hybrid" in name


def resolve_snapshot(hf_cache: str | Path, model: str, revision: str | None = None) -> Path | None:
    """The snapshot dir to serve/prepare, or None.

    A given revision (commit or ref name) must exist; otherwise refs/main, then refs/master,
    then the most recently modified snapshot dir that is not a prepared variant.
    """
    repo = repo_dir(hf_cache, model)
    snaps = repo / "snapshots"
    if revision:
        commit = revision if _REV.fullmatch(revision) else (_read_ref(repo, revision) or revision)
        cand = snaps / commit
        return cand if cand.is_dir() and not is_variant_name(commit) else None
    for ref in ("main", "master"):
        commit = _read_ref(repo, ref)
        if commit and (snaps / commit).is_dir():
            return snaps / commit
    try:
        dirs = [d for d in snaps.iterdir() if d.is_dir() and not is_variant_name(d.name)]
    except OSError:
        return None
    if not dirs:
        return None
    return max(dirs, key=lambda d: (d.stat().st_mtime, d.name))


def _load_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def quant_config(snapshot: Path) -> dict | None:
    """config.json's quantization_config (top level or text_config), else hf_quant_config.json."""
    cfg = _load_json(snapshot / "config.json") or {}
    for holder in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        q = holder.get("quantization_config")
        if isinstance(q, dict):
            return q
    hq = _load_json(snapshot / QUANT_FILE)
    if hq is not None:
        q = hq.get("quantization")
        return q if isinstance(q, dict) else hq
    return None


def has_quant_config(snapshot: Path) -> bool:
    return (snapshot / QUANT_FILE).is_file() or quant_config(snapshot) is not None


def quant_method(snapshot: Path) -> str | None:
    """`modelopt`, `fp8`, `compressed-tensors` (also inferred from config_groups), … or None.

    hf_quant_config.json alone (no quant_method field) is ModelOpt's own file: `modelopt`.
    """
    cfg = _load_json(snapshot / "config.json") or {}
    for holder in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        q = holder.get("quantization_config")
        if isinstance(q, dict):
            method = q.get("quant_method")
            if isinstance(method, str) and method:
                return method
            if "config_groups" in q:
                return "compressed-tensors"
    if (snapshot / QUANT_FILE).is_file():
        return "modelopt"
    return None


def leaves_snapshot(fname: str) -> bool:
    """True for an index entry that names a path out of the snapshot (absolute, `..`, NUL):
    the rule the safetensors index reader applies (flash_common.stheader._check_shard_name)."""
    parts = fname.replace("\\", "/").split("/")
    return not fname or fname.startswith("/") or ".." in parts or "\x00" in fname


def _index_shards(snapshot: Path) -> tuple[list[str] | None, list[str]]:
    """(distinct shard names, entries that leave the snapshot); (None, []) if unreadable."""
    idx = _load_json(Path(snapshot) / INDEX)
    if idx is None or not isinstance(idx.get("weight_map"), dict):
        return None, []
    names = {v for v in idx["weight_map"].values() if isinstance(v, str)}
    return sorted(names), sorted(n for n in names if leaves_snapshot(n))


def index_files(snapshot: Path) -> list[str] | None:
    """Distinct file names the index weight_map points to (sorted), None if unreadable or if
    any entry names a path outside the snapshot (`../x`, `/etc/x`)."""
    shards, bad = _index_shards(snapshot)
    return None if bad else shards


def missing_files(snapshot: Path) -> list[str]:
    """Names that must exist for a servable snapshot and don't (dangling links count).

    Essential files, a quant config, and every shard the index names. An unreadable index is
    reported as `model.safetensors.index.json (unreadable)`.
    """
    snapshot = Path(snapshot)
    missing = [name for name in ESSENTIAL if not (snapshot / name).is_file()]  # is_file follows links
    if not has_quant_config(snapshot):
        missing.append("quantization config (hf_quant_config.json or config.json quantization_config)")
    if (snapshot / INDEX).is_file():
        shards, bad = _index_shards(snapshot)
        if shards is None:
            missing.append(f"{INDEX} (unreadable)")
        elif bad:
            missing.append(f"{INDEX} (weight_map names paths outside the snapshot: {', '.join(map(repr, bad[:3]))})")
        else:
            missing.extend(s for s in shards if not (snapshot / s).is_file())
    return missing


def variant_dir(snapshot: Path, mode: str) -> Path:
    if mode not in VARIANT_SUFFIX:
        raise ValueError(f"unknown MODE {mode!r}; accepted: {', '.join(VARIANT_SUFFIX)}")
    snapshot = Path(snapshot)
    suffix = VARIANT_SUFFIX[mode]
    return snapshot if not suffix else snapshot.with_name(snapshot.name + suffix)


def read_marker(variant: Path) -> dict | None:
    return _load_json(Path(variant) / MARKER)


def variant_state(snapshot: Path, mode: str) -> str:
    """`ready`, `stale` or `absent`.

    nvfp4: the snapshot itself; ready when complete, stale when present but incomplete.
    hybrid / hybrid-mtp: absent without a `.prepared` marker (a half-built dir is never
    marked); stale when the marker is from another source revision or format, the variant
    misses files, or the snapshot has files the variant lacks (tokenizer updated after prep).
    """
    snapshot = Path(snapshot)
    if mode == "nvfp4":
        if not snapshot.is_dir():
            return "absent"
        return "stale" if missing_files(snapshot) else "ready"
    var = variant_dir(snapshot, mode)
    if not (var / MARKER).exists():
        return "absent"
    marker = read_marker(var)
    if (
        marker is None
        or marker.get("source_revision") != snapshot.name
        or marker.get("format") != VARIANT_FORMAT[mode]
        or missing_files(var)
    ):
        return "stale"
    if mode == "hybrid-mtp":  # built on the hybrid: a rebuilt or broken hybrid makes it stale
        base = read_marker(variant_dir(snapshot, "hybrid")) or {}
        if variant_state(snapshot, "hybrid") != "ready" or not base.get("build_id") \
                or marker.get("hybrid_build") != base["build_id"]:
            return "stale"
    try:
        wanted = {p.name for p in snapshot.iterdir() if not p.name.startswith(".")}
    except OSError:
        return "stale"
    have = {p.name for p in var.iterdir()}
    return "stale" if wanted - have else "ready"
