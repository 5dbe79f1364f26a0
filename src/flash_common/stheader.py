"""Strict, bounded safetensors header reader (no numpy, no torch, no safetensors import).

Used by the PLE engine (shard map), by `flash verify` (checkpoint pipeline) and by the planner
(weight sizes). It reads only the 8-byte length prefix and the JSON header, never tensor data.

API
---
``read_header(path) -> Header``
    Parse and validate the header of one ``.safetensors`` file. Raises ``HeaderError``.
``parse_header(raw, *, file_size, source="<bytes>") -> Header``
    Same validation on header bytes already in memory (``raw`` = the JSON bytes, without the
    8-byte prefix); ``file_size`` is the size of the whole file they came from. For fuzzing.
``read_index(model_dir) -> dict[str, str]``
    ``{tensor_name: shard_filename}`` from ``model.safetensors.index.json``; a directory with
    no index but a single ``model.safetensors`` maps every tensor of that file to it.
    Raises ``HeaderError`` (the index is checkpoint metadata too).
``Header``
    ``path``, ``header_len`` (JSON bytes), ``data_start`` (= 8 + header_len, absolute offset of
    the data section), ``file_size``, ``metadata`` (``dict[str, str]`` or ``None``),
    ``tensors`` (``dict[name, TensorInfo]`` in file order of their data), ``payload_bytes``.
``TensorInfo``
    ``name``, ``dtype`` (safetensors spelling, e.g. ``"F8_E4M3"``), ``shape`` (tuple of int),
    ``begin`` / ``end`` (absolute byte offsets in the file, end exclusive), ``nbytes``,
    ``numel``, ``bits`` (per element).
``DTYPE_BITS``
    Every dtype the format knows, with its width in bits (sub-byte F4/F6 included).
``HeaderError(ValueError)``
    ``path`` and ``problem`` attributes; ``str()`` names both.

What is checked (mirrors what the safetensors Rust loader refuses, so a file we accept loads):
header length ≥ 2, ≤ ``MAX_HEADER_BYTES`` (100 MB, the Rust cap) and inside the file; the header is
UTF-8 JSON, an object, no duplicate keys, no NaN/Infinity; ``__metadata__`` maps str to str;
each tensor entry has exactly ``dtype``/``shape``/``data_offsets``; the dtype is known; shape
entries are non-negative ints; offsets are ints with ``0 <= begin <= end``; ``numel × bits / 8 ==
end - begin`` (and whole bytes); tensors neither overlap nor leave holes, and together cover the data
section exactly to the end of the file (a truncated or padded file is an error). Nothing is
allocated in proportion to a declared size: shapes are multiplied as Python ints, and the header is
read only after its length is checked against the real file size.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "INDEX_NAME",
    "Header",
    "HeaderError",
    "TensorInfo",
    "parse_header",
    "read_header",
    "read_index",
]

# Same cap as safetensors' Rust loader (MAX_HEADER_SIZE = 100_000_000).
MAX_HEADER_BYTES = 100_000_000
# The index is JSON too; the real RadixArk index is 34 MB, so 512 MB means something is wrong.
MAX_INDEX_BYTES = 512 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"

# Every dtype safetensors 0.8 knows, with its width in bits.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "I64": 64,
    "U64": 64,
    "F64": 64,
}


class HeaderError(ValueError):
    """A safetensors header or index that cannot be trusted. Names the file and the problem."""

    def __init__(self, path: object, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int  # absolute, exclusive

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bits(self) -> int:
        return DTYPE_BITS[self.dtype]


@dataclass(frozen=True)
class Header:
    path: str
    header_len: int
    file_size: int
    metadata: dict[str, str] | None
    tensors: dict[str, TensorInfo] = field(repr=False)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def payload_bytes(self) -> int:
        return self.file_size - self.data_start


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Bad(f"duplicate key {k!r} in header JSON")
        out[k] = v
    return out


class _Bad(Exception):
    """Internal: a validation failure before the path is attached."""


def _reject_constant(name):
    raise _Bad(f"non-finite number {name} in header JSON")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _load_json(raw: bytes):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Bad(f"header is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except _Bad:
        raise
    except RecursionError:
        raise _Bad("header JSON nests too deeply") from None
    except ValueError as e:  # JSONDecodeError
        raise _Bad(f"header is not valid JSON ({e})") from None


def _validate(obj, header_len: int, file_size: int) -> tuple[dict | None, dict[str, TensorInfo]]:
    if not isinstance(obj, dict):
        raise _Bad(f"header JSON is a {type(obj).__name__}, expected an object")
    data_start = 8 + header_len
    data_len = file_size - data_start
    metadata = None
    entries = []
    for name, spec in obj.items():
        if name == "__metadata__":
            if not isinstance(spec, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in spec.items()
            ):
                raise _Bad("__metadata__ must map strings to strings")
            metadata = dict(spec)
            continue
        if not isinstance(spec, dict):
            raise _Bad(f"tensor {name!r}: entry is a {type(spec).__name__}, expected an object")
        keys = set(spec)
        if keys != {"dtype", "shape", "data_offsets"}:
            missing = {"dtype", "shape", "data_offsets"} - keys
            extra = keys - {"dtype", "shape", "data_offsets"}
            what = []
            if missing:
                what.append(f"missing {sorted(missing)}")
            if extra:
                what.append(f"unexpected {sorted(extra)}")
            raise _Bad(f"tensor {name!r}: {', '.join(what)}")
        dtype = spec["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise _Bad(
                f"tensor {name!r}: unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_BITS))})"
            )
        shape = spec["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _Bad(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
        offs = spec["data_offsets"]
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(_is_int(o) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise _Bad(f"tensor {name!r}: data_offsets {offs!r} must be [begin, end] ints with 0 <= begin <= end")
        begin, end = offs
        if end > data_len:
            raise _Bad(
                f"tensor {name!r}: data_offsets end {end} is past the data section "
                f"({data_len} bytes; file {file_size} bytes, data starts at {data_start})"
            )
        numel = 0 if 0 in shape else 1  # a zero dim makes the tensor empty whatever the others say
        for d in shape if numel else ():
            numel *= d
            if numel > data_len * 8:  # cap the int size early; such a tensor can't fit anyway
                break
        total_bits = numel * DTYPE_BITS[dtype]
        if total_bits % 8:
            raise _Bad(f"tensor {name!r}: {numel} × {dtype} is not a whole number of bytes")
        if total_bits // 8 != end - begin:
            raise _Bad(
                f"tensor {name!r}: shape {shape} × {dtype} needs {total_bits // 8} bytes "
                f"but data_offsets span {end - begin}"
            )
        entries.append(TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end))
    entries.sort(key=lambda t: (t.begin, t.end))
    pos = data_start
    for t in entries:
        if t.begin < pos:
            raise _Bad(f"tensor {t.name!r} overlaps the previous tensor (begins at {t.begin - data_start}, previous ends at {pos - data_start})")
        if t.begin > pos:
            raise _Bad(f"hole of {t.begin - pos} bytes before tensor {t.name!r} (data offset {pos - data_start})")
        pos = t.end
    if pos != file_size:
        raise _Bad(
            f"tensors cover {pos - data_start} bytes of data but the file holds {data_len} "
            f"({'truncated' if pos > file_size else 'trailing bytes'})"
        )
    return metadata, {t.name: t for t in entries}


def parse_header(raw: bytes, *, file_size: int, source: object = "<bytes>") -> Header:
    """Validate header JSON bytes (without the 8-byte prefix) of a file of ``file_size`` bytes."""
    header_len = len(raw)
    if header_len < 2:
        raise HeaderError(source, f"header length {header_len} is too small")
    if header_len > MAX_HEADER_BYTES:
        raise HeaderError(source, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + header_len > file_size:
        raise HeaderError(source, f"header length {header_len} runs past the end of the {file_size}-byte file")
    try:
        obj = _load_json(bytes(raw))
        metadata, tensors = _validate(obj, header_len, file_size)
    except _Bad as e:
        raise HeaderError(source, str(e)) from None
    return Header(str(source), header_len, file_size, metadata, tensors)


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of one safetensors file (reads only the header bytes)."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise HeaderError(p, f"file is {file_size} bytes, too short for the 8-byte length prefix")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise HeaderError(p, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte cap")
            if 8 + header_len > file_size:
                raise HeaderError(p, f"header length {header_len} runs past the end of the {file_size}-byte file")
            raw = f.read(header_len)
    except OSError as e:
        raise HeaderError(p, f"cannot read: {e.strerror or e}") from None
    if len(raw) != header_len:
        raise HeaderError(p, f"file shrank while reading the header ({len(raw)} of {header_len} bytes)")
    return parse_header(raw, file_size=file_size, source=p)


def _check_shard_name(index_path: str, tensor: str, fname) -> str:
    if not isinstance(fname, str) or not fname:
        raise HeaderError(index_path, f"weight_map[{tensor!r}] is {fname!r}, expected a file name")
    parts = fname.replace("\\", "/").split("/")
    if fname.startswith("/") or ".." in parts or "\x00" in fname:
        raise HeaderError(index_path, f"weight_map[{tensor!r}] = {fname!r} leaves the model directory")
    return fname


def read_index(model_dir: str | os.PathLike) -> dict[str, str]:
    """``{tensor_name: shard_filename}`` for a checkpoint directory (see module docstring)."""
    d = os.fspath(model_dir)
    index_path = os.path.join(d, INDEX_NAME)
    if not os.path.exists(index_path):
        single = os.path.join(d, "model.safetensors")
        if os.path.exists(single):
            return {name: "model.safetensors" for name in read_header(single).tensors}
        raise HeaderError(d, f"no {INDEX_NAME} and no model.safetensors in this directory")
    try:
        size = os.path.getsize(index_path)
        if size > MAX_INDEX_BYTES:
            raise HeaderError(index_path, f"index is {size} bytes, over the {MAX_INDEX_BYTES}-byte cap")
        with open(index_path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise HeaderError(index_path, f"cannot read: {e.strerror or e}") from None
    try:
        obj = _load_json(raw)
    except _Bad as e:
        raise HeaderError(index_path, str(e).replace("header", "index")) from None
    if not isinstance(obj, dict):
        raise HeaderError(index_path, f"index JSON is a {type(obj).__name__}, expected an object")
    wm = obj.get("weight_map")
    if not isinstance(wm, dict):
        raise HeaderError(index_path, "index has no 'weight_map' object")
    return {str(k): _check_shard_name(index_path, k, v) for k, v in wm.items()}
