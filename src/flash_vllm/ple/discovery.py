"""Finding the PLE table in a checkpoint: its shards through the index and the safetensors headers
(dtype, width, row counts, the fp8 scale, the small int64 buffers next to it)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from flash_common.stheader import HeaderError, read_header, read_index

SUPPORTED_DTYPES = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4}
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


def find_table(model_dir: str, layer: int | None = None):
    """Locate the table's shards through the index. Returns (prefix, shards, dtype, width, scale, buffers)."""
    try:
        wmap = read_index(model_dir)
    except HeaderError as e:
        raise PLETableError(str(e)) from None
    found: dict[str, dict[int, str]] = {}
    for name, fname in wmap.items():
        m = SHARD_RE.match(name)
        if m and (layer is None or int(m.group("layer")) == layer):
            found.setdefault(m.group("prefix"), {})[int(m.group("k"))] = fname
    if not found:
        what = f"layer {layer}" if layer is not None else "any layer"
        raise PLETableError(f"{model_dir}: no '…ple.ple_embedding.ngram_embedding.shard_<k>.weight' tensors for {what} in the index")
    if len(found) > 1:
        raise PLETableError(f"{model_dir}: PLE tables on several layers ({', '.join(sorted(found))}); pass layer=")
    prefix, by_k = next(iter(found.items()))
    ks = sorted(by_k)
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

    shards, dtype, width = [], None, None
    for k in ks:
        fname = by_k[k]
        name = f"{prefix}shard_{k}.weight"
        h = hdr(fname)
        t = h.tensors.get(name)
        if t is None:
            raise PLETableError(f"{h.path}: index maps {name} here but the file's header does not hold it")
        if t.dtype not in SUPPORTED_DTYPES:
            raise PLETableError(f"{h.path}: {name} has dtype {t.dtype} (supported: {', '.join(SUPPORTED_DTYPES)})")
        if len(t.shape) != 2:
            raise PLETableError(f"{h.path}: {name} has shape {list(t.shape)}, expected [rows, width]")
        if dtype is None:
            dtype, width = t.dtype, t.shape[1]
        elif (t.dtype, t.shape[1]) != (dtype, width):
            raise PLETableError(f"{h.path}: {name} is {t.dtype} x {t.shape[1]} but shard 0 is {dtype} x {width}")
        shards.append(ShardSpec(k, h.path, t.begin, t.shape[0]))
    scale = None
    sname = f"{prefix}weight_scale"
    if sname in wmap:
        h = hdr(wmap[sname])
        t = h.tensors.get(sname)
        if t is None:
            raise PLETableError(f"{h.path}: index maps {sname} here but the file's header does not hold it")
        scale = _read_scalar(h.path, t)
    if dtype.startswith("F8") and scale is None:
        raise PLETableError(f"{model_dir}: fp8 table without {sname}: rows cannot be dequantized")
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
    return prefix, shards, dtype, width, scale, buffers
