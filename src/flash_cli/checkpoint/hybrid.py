"""`flash prepare hybrid`: BF16 side layers → 128×128 block fp8 in `<snapshot>-fp8hybrid/`.

Convention: docs/decisions/hybrid-convention.md, ModelOpt FP8_PB_WO served natively by vLLM
(`X.weight` F8_E4M3 + `X.weight_scale` F32 4-D [N/128, 1, K/128, 1]; config.json and
hf_quant_config.json become MIXED_PRECISION with the module in `quantized_layers` and out of
the exclude lists, see quantcfg.py). Plan first (pure data: which files are rewritten, their
exact new sizes, the disk check), then build through the variant transaction (variant.py: in
`<snapshot>-fp8hybrid.partial/`, verify, write `.prepared`, rename into place). Streaming and out of order: worker threads convert row
strips of the side layers and `pwrite` them at their known places while the main thread copies
the untouched tensors kernel-side, so CPU and disk overlap and memory stays a few strips.
`flash prepare hybrid --source DIR [--dest DIR]` runs the same plan and build on any checkpoint directory.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .. import hfcache
from ..errors import ConfigError, WeightsMissing
from . import fp8, layout, quantcfg, stwriter, variant
from .layout import CheckpointError

CONVENTION = "FP8_PB_WO"
CONFIGS = ("config.json", "hf_quant_config.json")  # rewritten (real files), never linked
PARTIAL = variant.PARTIAL


@dataclass
class Target:
    name: str
    shape: tuple[int, int]
    begin: int
    nbytes: int


@dataclass
class FilePlan:
    name: str
    source_size: int
    new_size: int
    entries: list  # [(stwriter.Entry, ("copy", begin) | ("weight", Target) | ("scale", Target))]
    metadata: dict | None
    targets: int


@dataclass
class Plan:
    source: Path
    dest: Path
    files: list[FilePlan]
    linked: list[str]
    weight_map: dict[str, str]
    index_metadata: dict
    targets: list[str] = field(default_factory=list)
    bytes_needed: int = 0
    bytes_free: int = 0
    read_bytes: int = 0

    def as_dict(self) -> dict:
        return {
            "source": str(self.source),
            "dest": str(self.dest),
            "convention": CONVENTION,
            "tensors": len(self.targets),
            "rewrite": [{"file": f.name, "tensors": f.targets, "bytes_before": f.source_size, "bytes_after": f.new_size}
                        for f in self.files],
            "link": len(self.linked),
            "bytes_needed": self.bytes_needed,
            "bytes_free": self.bytes_free,
        }


def plan(source: Path, dest: Path) -> Plan:
    """Decide everything from the index and the headers; read no tensor data."""
    from flash_common.stheader import HeaderError, read_header

    source = Path(source)
    missing = hfcache.missing_files(source)
    if missing:
        raise WeightsMissing(f"{source} is incomplete, missing: {', '.join(missing[:8])}"
                             + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""),
                             hint="finish the download first: flash download (it resumes)")
    if hfcache.quant_method(source) == "compressed-tensors":
        raise ConfigError(f"{source} is a compressed-tensors checkpoint; the fp8 hybrid is built from "
                          "the ModelOpt NVFP4 exports only",
                          hint="serve it as published: flash serve published (MODE=nvfp4)")
    idx = layout.load_index(source)
    weight_map: dict[str, str] = idx["weight_map"]
    targets = sorted(k for k in weight_map if layout.SIDE_LAYER.fullmatch(k))
    done = [k + sfx for k in targets for sfx in (layout.SCALE_SUFFIX, layout.OLD_SCALE_SUFFIX) if k + sfx in weight_map]
    if done:
        raise CheckpointError(f"{source} already has fp8 side layers (e.g. {done[0]}); "
                              "the hybrid is made from the exports with BF16 side layers")
    if not targets:
        raise CheckpointError(f"{source}: no side-layer weights (linear_attn/self_attn/shared_expert) in the index")
    by_file = layout.files_of({k: weight_map[k] for k in targets})
    files: list[FilePlan] = []
    read_bytes = 0
    for fname in sorted(by_file):
        try:
            header = read_header(source / fname)
        except HeaderError as exc:
            raise CheckpointError(f"cannot plan the hybrid: {exc}", hint="flash verify names every problem") from None
        want = set(by_file[fname])
        entries = []
        ordered = sorted(header.tensors.values(), key=lambda t: t.begin)
        for t in ordered:
            if t.name not in want:
                entries.append((stwriter.Entry(t.name, t.dtype, t.shape, t.nbytes), ("copy", t.begin)))
                continue
            if t.dtype != "BF16" or len(t.shape) != 2 or t.shape[0] % fp8.BLOCK or t.shape[1] % fp8.BLOCK:
                raise CheckpointError(f"{fname}: {t.name} is {t.dtype} {list(t.shape)}; the hybrid needs BF16 2-D "
                                      f"weights with both dims divisible by {fp8.BLOCK}")
            tgt = Target(t.name, (t.shape[0], t.shape[1]), t.begin, t.nbytes)
            read_bytes += t.nbytes
            n, k = tgt.shape
            entries.append((stwriter.Entry(t.name, "F8_E4M3", tgt.shape, n * k), ("weight", tgt)))
            sshape = scale_shape(n, k)
            entries.append((stwriter.Entry(t.name + layout.SCALE_SUFFIX, "F32", sshape, (n // fp8.BLOCK) * (k // fp8.BLOCK) * 4),
                            ("scale", tgt)))
        missing_keys = want - set(header.tensors)
        if missing_keys:
            raise CheckpointError(f"{fname}: index key {sorted(missing_keys)[0]} is not in the file",
                                  hint="flash verify names every problem")
        new_size = stwriter.file_size([e for e, _ in entries], header.metadata)
        files.append(FilePlan(fname, header.file_size, new_size, entries, header.metadata, len(want)))
    rewritten = {f.name for f in files}
    linked = sorted(p.name for p in source.iterdir()
                    if not p.name.startswith(".") and p.name not in rewritten and p.name != layout.INDEX
                    and p.name not in CONFIGS)
    if not (source / "config.json").is_file():
        raise CheckpointError(f"{source}: no config.json; the hybrid edits its quantization_config")
    p = Plan(source, Path(dest), files, linked, weight_map, idx.get("metadata") or {}, targets, read_bytes=read_bytes)
    index_size = (source / layout.INDEX).stat().st_size
    p.bytes_needed = sum(f.new_size for f in files) + index_size * 2 + len(targets) * 200
    parent = Path(dest).parent
    p.bytes_free = shutil.disk_usage(parent if parent.exists() else source.parent).free
    return p


def scale_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """FP8_PB_WO's `weight_scale`: the [N/128, K/128] row-major grid as 4-D (same bytes)."""
    return (n // fp8.BLOCK, 1, k // fp8.BLOCK, 1)


def edited_configs(p: "Plan") -> tuple[dict, dict | None, dict]:
    """(config.json, hf_quant_config.json or None, summary) with the side layers as FP8_PB_WO."""
    import json

    cfg = json.loads((p.source / "config.json").read_text())
    hq_path = p.source / "hf_quant_config.json"
    hq = json.loads(hq_path.read_text()) if hq_path.is_file() else None
    modules = [n[: -len(".weight")] for n in p.targets]
    summary = quantcfg.edit(cfg, hq, modules, quantcfg.expert_prefixes(p.weight_map))
    return cfg, hq, summary


def _progress(total: int, desc: str):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)


def _strips(tgt: Target) -> list[tuple[int, int]]:
    """Row ranges (multiples of 128 rows, ≤ fp8.STRIP_ELEMS elements): the unit of work."""
    n, k = tgt.shape
    rows = max(fp8.BLOCK, (fp8.STRIP_ELEMS // max(k, 1)) // fp8.BLOCK * fp8.BLOCK)
    return [(r0, min(n, r0 + rows)) for r0 in range(0, n, rows)]


def _convert_strip(src_fd: int, tgt: Target, r0: int, r1: int, writer) -> float:
    """Read rows [r0, r1) of a BF16 weight, quantize, and write codes and scales in place."""
    import numpy as np

    k = tgt.shape[1]
    want = (r1 - r0) * k * 2
    raw = os.pread(src_fd, want, tgt.begin + r0 * k * 2)
    if len(raw) != want:
        raise CheckpointError(f"short read of {tgt.name}: {len(raw)} of {want} bytes at row {r0}")
    stwriter.drop_cache(src_fd, tgt.begin + r0 * k * 2, want)  # read once; don't crowd the cache
    try:
        q, s, err = fp8.quantize_strip(np.frombuffer(raw, dtype=np.uint16), r1 - r0, k)
    except fp8.NonFiniteError:
        raise CheckpointError(f"{tgt.name} holds inf or NaN in rows {r0}–{r1 - 1}: no fp8 block scale "
                              "can represent it, so no hybrid is built",
                              hint="the source shard is corrupt or not the published export; "
                                   "flash verify --hash checks it against the Hub") from None
    writer.write_at(tgt.name, r0 * k, q)
    writer.write_at(tgt.name + layout.SCALE_SUFFIX, (r0 // fp8.BLOCK) * (k // fp8.BLOCK) * 4, s)
    return err


def workers_default() -> int:
    return max(1, min(os.cpu_count() or 1, 16))


def write_file(fp: FilePlan, src_path: Path, dst_path: Path, pool: ThreadPoolExecutor, bar=None,
               on_write=None) -> tuple[float, list[tuple[str, float]]]:
    """Rewrite one shard. Returns (worst rel err, [(tensor, its worst rel err)]).

    Every tensor's place in the new file is known from its header, so nothing waits for order:
    the workers read, convert and `pwrite` row strips (a few MB each; the pool's queue holds
    only job descriptions, so memory is ~workers × 40 MB whatever the tensor sizes) while this
    thread copies the untouched tensors kernel-side. CPU and disk overlap fully.
    """
    src_fd = os.open(src_path, os.O_RDONLY)
    writer = stwriter.PositionalWriter(dst_path, [e for e, _ in fp.entries], fp.metadata, on_write=on_write)
    futures: list = []
    try:
        for _, src in fp.entries:
            if src[0] == "weight":
                tgt = src[1]
                futures.append((tgt.name, [pool.submit(_convert_strip, src_fd, tgt, r0, r1, writer)
                                           for r0, r1 in _strips(tgt)]))
        for entry, src in fp.entries:
            if src[0] == "copy":
                writer.copy_into(entry.name, src_fd, src[1])
                if bar is not None:
                    bar.update(entry.nbytes)
        worst = 0.0
        per_tensor: list[tuple[str, float]] = []
        for name, futs in futures:
            err = max(f.result() for f in futs)
            worst = max(worst, err)
            per_tensor.append((name, err))
            if bar is not None:
                bar.update(writer.sizes[name] + writer.sizes[name + layout.SCALE_SUFFIX])
        writer.close(fsync=False)  # synced in build() before the marker; the next file overlaps this writeback
    except BaseException:
        for _, futs in futures:
            for f in futs:
                f.cancel()
        for _, futs in futures:  # workers still hold the fds: let running strips finish first
            for f in futs:
                try:
                    f.result()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
        writer.abort()
        raise
    finally:
        os.close(src_fd)
    os.chmod(dst_path, 0o644)
    return worst, per_tensor


class _Keys:
    """What the gate needs of a linked shard's header: its tensor names."""

    def __init__(self, tensors: dict):
        self.tensors = tensors


def _linked_header(path: Path):
    """A light check of a shard the variant links unchanged (the source's own file): the header
    parses and every tensor's data lies inside the file. `flash verify` validates these files in
    full (dtypes × shapes = sizes, contiguity); the gate re-checks only what linking could break.
    None when anything looks off: the gate then reads it in full and reports the problem."""
    import json
    import struct

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                return None
            n = struct.unpack("<Q", raw)[0]
            if n > min(size - 8, 256 << 20):
                return None
            obj = json.loads(f.read(n))
        room = size - 8 - n
        tensors = {}
        for k, v in obj.items():
            if k == "__metadata__":
                continue
            b, e = v["data_offsets"]
            if not (0 <= b <= e <= room):
                return None
            tensors[k] = v
        return _Keys(tensors)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def linked_headers(p: Plan) -> dict:
    """Light headers of the shards the variant links (see _linked_header). Runs in a thread
    while the rewritten shards are written: the full validation of ~300k tensors costs ~7 s of
    CPU (~23 µs/tensor), which would otherwise come after the writes; this costs well under 1 s."""
    out = {}
    for name in sorted(set(p.weight_map.values()) & set(p.linked)):
        h = _linked_header(p.source / name)
        if h is not None:
            out[name] = h
    return out


def check_built(p: Plan, directory: Path, known_headers: dict | None = None) -> list[str]:
    """The static gate before `.prepared`: verify + the convention holds for every target."""
    from . import verify

    res = verify.structure(directory, known_headers=known_headers)
    problems = list(res.problems)
    for name in p.targets:
        fname = p.weight_map[name]
        header = res.headers.get(fname)
        if header is None:
            continue  # already reported
        w = header.tensors.get(name)
        s = header.tensors.get(name + layout.SCALE_SUFFIX)
        if w is None or w.dtype != "F8_E4M3" or s is None or s.dtype != "F32" \
                or s.shape != scale_shape(*w.shape):
            problems.append(f"{fname}: {name} is not F8_E4M3 + F32 [N/128,1,K/128,1] weight_scale")
    import json

    try:
        cfg = json.loads((directory / "config.json").read_text())
        hq_path = directory / "hf_quant_config.json"
        hq = json.loads(hq_path.read_text()) if hq_path.is_file() else None
    except (OSError, ValueError) as exc:
        return problems + [f"unreadable config: {exc}"]
    problems += quantcfg.problems(cfg, hq, [n[: -len(".weight")] for n in p.targets])
    return problems


def build(p: Plan, on_write=None, workers: int | None = None, progress=None) -> dict:
    """Execute a plan through the variant transaction (variant.py): link the untouched files,
    write the edited configs, rewrite the shards (fp8), index, gate, `.prepared`, rename.
    Returns the marker. `progress(text)` gets one line per shard when no TTY bar is shown."""
    cfg, hq, qsummary = edited_configs(p)  # before any work: a config we cannot edit stops here
    t0 = time.monotonic()
    weight_map = dict(p.weight_map)
    for name in p.targets:
        weight_map[name + layout.SCALE_SUFFIX] = weight_map[name]
    modules = [n[: -len(".weight")] for n in p.targets]

    def write(partial: Path) -> dict:
        worst = 0.0
        log = []
        bar = _progress(sum(f.new_size for f in p.files), "fp8 hybrid")
        with ThreadPoolExecutor(max_workers=1) as side, \
                ThreadPoolExecutor(max_workers=workers or workers_default()) as pool:
            known = side.submit(linked_headers, p)
            for i, fp in enumerate(p.files, 1):
                if bar is None and progress is not None:
                    progress(f"  [{i}/{len(p.files)}] {fp.name}: {fp.targets} tensors → fp8 ({fp.new_size / 1e9:.2f} GB)")
                w, per = write_file(fp, p.source / fp.name, partial / fp.name, pool, bar, on_write)
                worst = max(worst, w)
                log.extend(per)
            known_headers = known.result()
        if bar is not None:
            bar.close()
        if worst > fp8.REL_ERR_BOUND * (1 + 1e-5):
            raise CheckpointError(f"worst per-block relative error {worst:.4f} exceeds the e4m3 bound "
                                  f"{fp8.REL_ERR_BOUND:.4f}: the conversion is wrong, nothing was marked prepared")
        with open(partial / "fp8_convert.log", "w") as f:
            for name, err in log:
                f.write(f"{name}\tworst_block_rel_err={err:.6f}\n")
            f.write(f"tensors={len(log)} worst={worst:.6f} bound={fp8.REL_ERR_BOUND:.6f}\n")
        return {"worst": worst, "known_headers": known_headers}

    return variant.build(variant.Build(
        kind="hybrid", what="hybrid", source=p.source, dest=Path(p.dest),
        links=[(p.source / name, name) for name in p.linked],
        configs={"config.json": cfg, **({"hf_quant_config.json": hq} if hq is not None else {})},
        rewritten=[fp.name for fp in p.files], weight_map=weight_map, index_metadata=p.index_metadata,
        write=write,
        gate=lambda partial, written: check_built(p, partial, written["known_headers"]),
        marker=lambda written: dict(
            convention=CONVENTION, block=[fp8.BLOCK, fp8.BLOCK], tensors=len(p.targets),
            worst_block_rel_err=round(written["worst"], 6), rewritten=[fp.name for fp in p.files],
            quant_config=qsummary, modules=modules, seconds=round(time.monotonic() - t0, 1)),
        bytes_needed=p.bytes_needed, bytes_free=p.bytes_free))


def repair_links(source: Path, dest: Path) -> list[str]:
    """A prepared variant whose snapshot gained files (e.g. a fixed chat template): link them in."""
    have = {p.name for p in dest.iterdir()}
    added = []
    for p in sorted(source.iterdir()):
        if p.name.startswith(".") or p.name in have or p.name.endswith(".safetensors") or p.name == layout.INDEX \
                or p.name in CONFIGS:
            continue
        layout.link_relative(p, dest / p.name)
        added.append(p.name)
    return added


def prepare(source: Path, dry_run: bool = False, force: bool = False, progress=None) -> dict:
    """Idempotent entry point for a snapshot dir: ready → nothing; repairable → links; else build."""
    source = Path(source)
    dest = hfcache.variant_dir(source, "hybrid")
    state = hfcache.variant_state(source, "hybrid")
    if state == "ready" and not force:
        return {"action": "none", "state": state, "dest": str(dest)}
    if state == "stale" and not force:
        m = hfcache.read_marker(dest) or {}
        if (m.get("source_revision") == source.name and m.get("format") == hfcache.VARIANT_FORMAT["hybrid"]
                and all((dest / n).is_file() for n in [layout.INDEX, "config.json", *m.get("rewritten", [])])):
            if dry_run:
                return {"action": "repair", "state": state, "dest": str(dest)}
            added = repair_links(source, dest)
            if hfcache.variant_state(source, "hybrid") == "ready":
                return {"action": "repaired", "state": "ready", "dest": str(dest), "added": added}
    p = plan(source, dest)
    if dry_run:
        return {"action": "build", "state": state, "plan": p.as_dict()}
    data = build(p, progress=progress)
    return {"action": "built", "state": "ready", "dest": str(dest), "marker": data}
