"""Finding the PLE table in a checkpoint: its shards through the index and the safetensors headers
(dtype, width, row counts, the fp8 scale, the small int64 buffers next to it).

Two table formats: row tables (`shard_<k>.weight` F8/BF16/F16/F32 [rows, width] + an optional
per-tensor `weight_scale`: `find_table`) and NVFP4 tables (ModelOpt's QAD export: `shard_<k>.weight`
U8 [rows, width/2] packed E2M1 codes + `shard_<k>.weight_scale` F8_E4M3 [rows, width/16] block scales
+ one F32 `weight_scale_2`: `find_nvfp4`). `table_format` tells them apart from the index and headers."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from flash_common.stheader import HeaderError, read_header, read_index

SUPPORTED_DTYPES = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4}
# what PLETable can map: the row dtypes, plus raw bytes (the NVFP4 table's codes and block scales,
# decoded by nvfp4.py, never viewed as values by the stager)
ROW_BYTES = {**SUPPORTED_DTYPES, "U8": 1}
NVFP4_BLOCK = 16  # E2M1 values per E4M3 block scale (ModelOpt NVFP4 group size)
SHARD_RE = re.compile(r"^(?P<prefix>.*layers\.(?P<layer>\d+)\.ple\.ple_embedding\.ngram_embedding\.)shard_(?P<k>\d+)\.weight$")


class PLETableError(ValueError):
    """The checkpoint does not hold a usable PLE table; the message says which file and why."""


@dataclass(frozen=True)
class ShardSpec:
    index: int
    path: str
    begin: int  # absolute byte offset of row 0 in the file
    rows: int


def _read_scalar(path: str, t) -> float:
    import numpy as np

    if t.numel != 1:
        raise PLETableError(f"{path}: {t.name} has shape {list(t.shape)}, expected one value")
    with open(path, "rb") as f:
        f.seek(t.begin)
        raw = f.read(t.nbytes)
    if t.dtype == "F32":
        return float(np.frombuffer(raw, "<f4")[0])
    if t.dtype == "F16":
        return float(np.frombuffer(raw, "<f2")[0])
    if t.dtype == "BF16":
        return float((np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)[0])
    raise PLETableError(f"{path}: {t.name} has dtype {t.dtype}, expected F32/BF16/F16")


def _locate(model_dir: str, layer: int | None):
    """(weight map, table prefix, shard indices 0..n-1, header reader) of the one PLE table."""
    try:
        wmap = read_index(model_dir)
    except HeaderError as e:
        raise PLETableError(str(e)) from None
    found: dict[str, set[int]] = {}
    for name in wmap:
        m = SHARD_RE.match(name)
        if m and (layer is None or int(m.group("layer")) == layer):
            found.setdefault(m.group("prefix"), set()).add(int(m.group("k")))
    if not found:
        what = f"layer {layer}" if layer is not None else "any layer"
        raise PLETableError(f"{model_dir}: no '…ple.ple_embedding.ngram_embedding.shard_<k>.weight' tensors for {what} in the index")
    if len(found) > 1:
        raise PLETableError(f"{model_dir}: PLE tables on several layers ({', '.join(sorted(found))}); pass layer=")
    prefix, ks = next(iter(found.items()))
    ks = sorted(ks)
    if ks != list(range(len(ks))):
        missing = sorted(set(range(ks[-1] + 1)) - set(ks))
        raise PLETableError(f"{model_dir}: table shards are not contiguous; missing shard(s) {missing[:8]}")
    headers = {}

    def hdr(fname):
        if fname not in headers:
            p = os.path.join(model_dir, fname)
            try:
                headers[fname] = read_header(p)
            except HeaderError as e:
                raise PLETableError(str(e)) from None
        return headers[fname]

    return wmap, prefix, ks, hdr


def _tensor(model_dir, wmap, hdr, name):
    """The header entry of `name` (through the index), or PLETableError naming what is missing."""
    if name not in wmap:
        raise PLETableError(f"{model_dir}: the index has no {name}")
    h = hdr(wmap[name])
    t = h.tensors.get(name)
    if t is None:
        raise PLETableError(f"{h.path}: index maps {name} here but the file's header does not hold it")
    return h.path, t


def _shards(model_dir, wmap, hdr, prefix, ks, leaf: str, accept) -> tuple[list[ShardSpec], str, int]:
    """Every `shard_<k>.<leaf>`: 2-D, one dtype and width across shards (dtype in `accept`)."""
    shards, dtype, width = [], None, None
    for k in ks:
        name = f"{prefix}shard_{k}.{leaf}"
        path, t = _tensor(model_dir, wmap, hdr, name)
        if t.dtype not in accept:
            raise PLETableError(f"{path}: {name} has dtype {t.dtype} (supported: {', '.join(accept)})")
        if len(t.shape) != 2:
            raise PLETableError(f"{path}: {name} has shape {list(t.shape)}, expected [rows, width]")
        if dtype is None:
            dtype, width = t.dtype, t.shape[1]
        elif (t.dtype, t.shape[1]) != (dtype, width):
            raise PLETableError(f"{path}: {name} is {t.dtype} x {t.shape[1]} but shard 0 is {dtype} x {width}")
        shards.append(ShardSpec(k, path, t.begin, t.shape[0]))
    return shards, dtype, width


def _buffers(wmap, hdr, prefix) -> dict:
    buffers = {}
    base = prefix[: -len("ngram_embedding.")]
    for b in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"):
        if base + b in wmap:
            h = hdr(wmap[base + b])
            t = h.tensors.get(base + b)
            if t is not None and t.dtype == "I64" and t.nbytes <= 1 << 16:
                import numpy as np

                with open(h.path, "rb") as f:
                    f.seek(t.begin)
                    buffers[b] = np.frombuffer(f.read(t.nbytes), "<i8").copy()
    return buffers


def table_format(model_dir: str, layer: int | None = None) -> str:
    """"nvfp4" when shard 0's rows are U8 codes (ModelOpt NVFP4), else "rows"."""
    wmap, prefix, _, hdr = _locate(model_dir, layer)
    _, t = _tensor(model_dir, wmap, hdr, f"{prefix}shard_0.weight")
    return "nvfp4" if t.dtype == "U8" else "rows"


def find_table(model_dir: str, layer: int | None = None):
    """Locate the table's shards through the index. Returns (prefix, shards, dtype, width, scale, buffers)."""
    wmap, prefix, ks, hdr = _locate(model_dir, layer)
    shards, dtype, width = _shards(model_dir, wmap, hdr, prefix, ks, "weight", SUPPORTED_DTYPES)
    scale = None
    sname = f"{prefix}weight_scale"
    if sname in wmap:
        path, t = _tensor(model_dir, wmap, hdr, sname)
        scale = _read_scalar(path, t)
    if dtype.startswith("F8") and scale is None:
        raise PLETableError(f"{model_dir}: fp8 table without {sname}: rows cannot be dequantized")
    return prefix, shards, dtype, width, scale, _buffers(wmap, hdr, prefix)


def find_nvfp4(model_dir: str, layer: int | None = None):
    """Locate an NVFP4 table: (prefix, code shards, scale shards, values per row, weight_scale_2, buffers).

    Codes and block scales are separate tensors (possibly in separate files); each must exist for
    every shard with the same row count: codes without their scales would decode as garbage."""
    wmap, prefix, ks, hdr = _locate(model_dir, layer)
    codes, _, cw = _shards(model_dir, wmap, hdr, prefix, ks, "weight", ("U8",))
    for k in ks:
        if f"{prefix}shard_{k}.weight_scale" not in wmap:
            raise PLETableError(f"{model_dir}: NVFP4 table shard_{k}.weight has no shard_{k}.weight_scale "
                                "(the E4M3 block scales) in the index")
    scales, _, sw = _shards(model_dir, wmap, hdr, prefix, ks, "weight_scale", ("F8_E4M3",))
    width = 2 * cw
    if width % NVFP4_BLOCK or sw != width // NVFP4_BLOCK:
        raise PLETableError(f"{model_dir}: NVFP4 table of {cw} code bytes a row ({width} values) needs "
                            f"{width // NVFP4_BLOCK} block scales a row (one per {NVFP4_BLOCK}), the shards have {sw}")
    for c, sc in zip(codes, scales):
        if c.rows != sc.rows:
            raise PLETableError(f"{model_dir}: NVFP4 shard_{c.index} has {c.rows} code rows but {sc.rows} scale rows")
    gname = f"{prefix}weight_scale_2"
    if gname not in wmap:
        raise PLETableError(f"{model_dir}: NVFP4 table without {gname} (the global scale): rows cannot be decoded")
    path, t = _tensor(model_dir, wmap, hdr, gname)
    if t.dtype != "F32":
        raise PLETableError(f"{path}: {gname} has dtype {t.dtype}, expected F32")
    return prefix, codes, scales, width, _read_scalar(path, t), _buffers(wmap, hdr, prefix)
