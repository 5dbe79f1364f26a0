"""Write synthetic PLE checkpoints in the real file layouts (tests and lab/bench_ple.py).

``write_checkpoint(dir, layout="radixark"|"nvidia", rows_per_shard=, num_shards=, last_rows=,
dtype="F8_E4M3", width=160, scale=0.03125, seed=0)`` (``dtype="NVFP4"``: per shard U8 codes +
F8_E4M3 block scales, ``scale`` as the F32 ``weight_scale_2``; ``scales_apart``: the block scales
in a file of their own) writes real safetensors files (header JSON
with keys in sorted order, data in header-key order like safetensors, 8-byte aligned header) plus
``model.safetensors.index.json``, streaming the table in blocks (a 20 GiB table never sits in
memory). Row bytes are seeded random per shard. Returns the written file names.

RadixArk: 10 files ``model-plefp8-0000{0..9}.safetensors``, shards spread 13 per file, the last file
the remainder plus ``weight_scale`` and the three I64 buffers; a dummy BF16 tensor opens each file
so data offsets are not trivial. nvidia: every shard, the scale and a few ``mtp.*`` tensors in the
one file ``model-fp8-mtp-ple.safetensors``.
"""

from __future__ import annotations

import json
import os
import struct

PREFIX = "model.language_model.layers.1.ple.ple_embedding."
_ITEM = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8, "U8": 1}


def _scale_bytes(scale: float, dtype: str) -> bytes:
    import numpy as np

    if dtype == "BF16":
        return (np.array([scale], np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    if dtype == "F16":
        return np.array([scale], "<f2").tobytes()
    return np.array([scale], "<f4").tobytes()


def _write_file(path: str, tensors: list[tuple[str, str, list[int], object]], block: int = 64 << 20) -> None:
    """tensors: (name, dtype, shape, data) where data is bytes or a callable(offset, n) -> bytes."""
    tensors = sorted(tensors, key=lambda t: t[0])
    header, pos, sizes = {}, 0, []
    for name, dtype, shape, _ in tensors:
        n = _ITEM[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
        sizes.append(n)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw)) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (name, _, _, data), n in zip(tensors, sizes):
            if callable(data):
                off = 0
                while off < n:
                    k = min(block, n - off)
                    f.write(data(off, k))
                    off += k
            else:
                assert len(data) == n, name
                f.write(data)
    os.replace(tmp, path)


def _shard_data(seed: int, k: int, finite: bool = False):
    import numpy as np

    def gen(off: int, n: int) -> bytes:
        rng = np.random.default_rng([seed, k, off])
        b = rng.integers(0, 256, n, dtype=np.uint8)
        if finite:  # no E4M3 NaN codes (S.1111.111): a benchmark table must not feed NaNs to the model
            b[(b & 0x7F) == 0x7F] -= 1
        return b.tobytes()

    return gen


def write_checkpoint(directory, layout: str = "radixark", rows_per_shard: int = 1000, num_shards: int = 128,
                     last_rows: int | None = None, dtype: str = "F8_E4M3", width: int = 160,
                     scale: float | None = 0.03125, scale_dtype: str = "BF16", seed: int = 0,
                     buffers: dict | None = None, per_file: int = 13, finite: bool = False,
                     scales_apart: bool = False) -> list[str]:
    import numpy as np

    d = os.fspath(directory)
    os.makedirs(d, exist_ok=True)
    last = rows_per_shard if last_rows is None else last_rows
    shard_tensors = []
    nvfp4 = dtype == "NVFP4"  # ModelOpt's: U8 codes [rows, w/2] + F8_E4M3 block scales [rows, w/16] per shard
    for k in range(num_shards):
        rows = last if k == num_shards - 1 else rows_per_shard
        if nvfp4:
            shard_tensors.append((f"{PREFIX}ngram_embedding.shard_{k}.weight", "U8", [rows, width // 2],
                                  _shard_data(seed, k)))
            shard_tensors.append((f"{PREFIX}ngram_embedding.shard_{k}.weight_scale", "F8_E4M3", [rows, width // 16],
                                  _shard_data(seed + 1, k, finite)))
        else:
            shard_tensors.append((f"{PREFIX}ngram_embedding.shard_{k}.weight", dtype, [rows, width],
                                  _shard_data(seed, k, finite)))
    extra = []
    if scale is not None and nvfp4:
        extra.append((f"{PREFIX}ngram_embedding.weight_scale_2", "F32", [1], _scale_bytes(scale, "F32")))
    elif scale is not None:
        extra.append((f"{PREFIX}ngram_embedding.weight_scale", scale_dtype, [1], _scale_bytes(scale, scale_dtype)))
    for name, vals in (buffers or {}).items():
        extra.append((PREFIX + name, "I64", [len(vals)], np.asarray(vals, "<i8").tobytes()))
    files: dict[str, list] = {}
    if scales_apart:  # NVFP4 block scales in a file of their own: codes and scales resolved apart
        files["model-ple-scales.safetensors"] = [t for t in shard_tensors if t[0].endswith(".weight_scale")]
        shard_tensors = [t for t in shard_tensors if not t[0].endswith(".weight_scale")]
    if layout == "radixark":
        nfiles = -(-num_shards // per_file)
        for i, t in enumerate(shard_tensors):
            files.setdefault(f"model-plefp8-{i // per_file:05d}.safetensors", []).append(t)
        lastf = f"model-plefp8-{nfiles - 1:05d}.safetensors"
        files[lastf].extend(extra)
        for j, fname in enumerate(sorted(files)):
            files[fname].append((f"aaa.dummy_{j}", "BF16", [37], bytes(74)))
    elif layout == "nvidia":
        fname = "model-fp8-mtp-ple.safetensors"
        files[fname] = shard_tensors + extra + [
            ("mtp.layers.0.mlp.experts.0.down_proj.weight", "F8_E4M3", [64, 32], bytes(2048)),
            ("mtp.fc.weight", "BF16", [3, 5], bytes(30)),
        ]
    else:
        raise ValueError(f"layout {layout!r} is not radixark or nvidia")
    wmap = {}
    for fname, tensors in files.items():
        _write_file(os.path.join(d, fname), tensors)
        for t in tensors:
            wmap[t[0]] = fname
    idx = {"metadata": {"total_size": sum(os.path.getsize(os.path.join(d, f)) for f in files)}, "weight_map": wmap}
    tmp = os.path.join(d, "model.safetensors.index.json.tmp")
    with open(tmp, "w") as f:
        json.dump(idx, f)
    os.replace(tmp, os.path.join(d, "model.safetensors.index.json"))
    return sorted(files)


def reference_rows(directory, ids):
    """table[ids] by an independent path: one np.memmap per shard from the raw header bytes."""
    import numpy as np

    d = os.fspath(directory)
    wmap = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    shards = {}
    for name, fname in wmap.items():
        if ".ngram_embedding.shard_" in name:
            k = int(name.rsplit("shard_", 1)[1].split(".")[0])
            p = os.path.join(d, fname)
            with open(p, "rb") as f:
                hl = struct.unpack("<Q", f.read(8))[0]
                h = json.loads(f.read(hl))
            e = h[name]
            rb = (e["data_offsets"][1] - e["data_offsets"][0]) // e["shape"][0]
            shards[k] = np.memmap(p, np.uint8, "r", offset=8 + hl + e["data_offsets"][0], shape=(e["shape"][0], rb))
    rps = shards[0].shape[0]
    ids = np.asarray(ids, np.int64).reshape(-1)
    out = np.empty((ids.shape[0], shards[0].shape[1]), np.uint8)
    sh = ids // rps
    for k in np.unique(sh).tolist():
        m = sh == k
        out[m] = shards[k][ids[m] - k * rps]  # IndexError past a shard's end, like table[ids]
    return out
