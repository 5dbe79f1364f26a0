"""safetensors header reader: accepts what safetensors writes, rejects malformed files by name."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from flash_common.stheader import (
    MAX_HEADER_BYTES,
    HeaderError,
    parse_header,
    read_header,
    read_index,
)


def _write(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_matches_safetensors_writer(tmp_path):
    from safetensors.numpy import save_file

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.int64)
    c = np.zeros((0, 7), dtype=np.float16)
    f = tmp_path / "m.safetensors"
    save_file({"a": a, "b": b, "c": c}, str(f), metadata={"format": "np"})
    h = read_header(f)
    assert h.metadata == {"format": "np"}
    assert h.file_size == f.stat().st_size
    assert set(h.tensors) == {"a", "b", "c"}
    raw = f.read_bytes()
    ta = h.tensors["a"]
    assert (ta.dtype, ta.shape, ta.nbytes) == ("F32", (3, 4), 48)
    assert np.array_equal(np.frombuffer(raw[ta.begin : ta.end], np.float32).reshape(3, 4), a)
    tb = h.tensors["b"]
    assert np.array_equal(np.frombuffer(raw[tb.begin : tb.end], np.int64), b)
    assert h.tensors["c"].nbytes == 0
    assert h.data_start == 8 + h.header_len
    assert h.payload_bytes == 48 + 40


def _ok_header():
    return {"x": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}


@pytest.mark.parametrize(
    "mutate, data_len, needle",
    [
        (lambda h: h["x"].update(dtype="F12"), 12, "unknown dtype 'F12'"),
        (lambda h: h["x"].update(shape=[2, -3]), 12, "non-negative"),
        (lambda h: h["x"].update(shape=[2, 3.0]), 12, "non-negative ints"),
        (lambda h: h["x"].update(shape=[2, True]), 12, "non-negative ints"),
        (lambda h: h["x"].update(data_offsets=[0, 10]), 10, "needs 12 bytes"),
        (lambda h: h["x"].update(data_offsets=[12, 0]), 12, "0 <= begin <= end"),
        (lambda h: h["x"].update(data_offsets=[0, 12, 3]), 12, "data_offsets"),
        (lambda h: h["x"].update(data_offsets=[0, 12]), 8, "past the data section"),
        (lambda h: h["x"].update(data_offsets=[0, 12]), 20, "trailing bytes"),
        (lambda h: h["x"].pop("shape"), 12, "missing ['shape']"),
        (lambda h: h["x"].update(extra=1), 12, "unexpected ['extra']"),
        (lambda h: h.update(__metadata__={"a": 1}), 12, "__metadata__"),
        (lambda h: h.update(y={"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}), 12, "overlaps"),
        (lambda h: h.update(y={"dtype": "U8", "shape": [4], "data_offsets": [16, 20]}), 20, "hole of 4 bytes"),
        (lambda h: h.update(y={"dtype": "F4", "shape": [3], "data_offsets": [12, 14]}), 14, "whole number of bytes"),
        (lambda h: h.update(y=[1, 2]), 12, "expected an object"),
        (lambda h: h["x"].update(shape=[10**30, 10**30]), 12, "needs"),
    ],
)
def test_rejects_bad_entries(tmp_path, mutate, data_len, needle):
    h = _ok_header()
    mutate(h)
    f = tmp_path / "bad.safetensors"
    _write(f, h, b"\0" * data_len)
    with pytest.raises(HeaderError) as ei:
        read_header(f)
    assert needle in str(ei.value)
    assert str(f) in str(ei.value)


def test_sub_byte_dtype_accepted(tmp_path):
    f = tmp_path / "f4.safetensors"
    _write(f, {"w": {"dtype": "F4", "shape": [4, 2], "data_offsets": [0, 4]}}, b"\x12" * 4)
    assert read_header(f).tensors["w"].nbytes == 4


@pytest.mark.parametrize(
    "blob, needle",
    [
        (b"", "too short"),
        (b"\x01\x00\x00", "too short"),
        (struct.pack("<Q", 2**63), "cap"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "cap"),
        (struct.pack("<Q", 1000) + b"{}", "past the end"),
        (struct.pack("<Q", 4) + b"[1] ", "expected an object"),
        (struct.pack("<Q", 3) + b"{x}", "not valid JSON"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "not UTF-8"),
        (struct.pack("<Q", 1) + b"{", "too small"),
        (struct.pack("<Q", 2000) + b"[" * 1000 + b"]" * 1000, "nests too deeply"),
    ],
)
def test_rejects_bad_framing(tmp_path, blob, needle):
    f = tmp_path / "frame.safetensors"
    f.write_bytes(blob)
    with pytest.raises(HeaderError, match=needle):
        read_header(f)


def test_duplicate_keys_and_nan_rejected():
    raw = b'{"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "x": {}}'
    with pytest.raises(HeaderError, match="duplicate key 'x'"):
        parse_header(raw, file_size=8 + len(raw) + 1)
    raw = b'{"x": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}'
    with pytest.raises(HeaderError, match="non-finite"):
        parse_header(raw, file_size=8 + len(raw) + 1)


def test_random_corruption_never_escapes_as_other_error(tmp_path):
    """Byte flips of a valid header either parse or raise HeaderError; nothing else."""
    good = json.dumps(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]}}
    ).encode()
    rng = np.random.default_rng(0)
    for _ in range(400):
        raw = bytearray(good)
        for pos in rng.integers(0, len(raw), size=rng.integers(1, 4)):
            raw[pos] = int(rng.integers(0, 256))
        try:
            parse_header(bytes(raw), file_size=8 + len(raw) + 16)
        except HeaderError:
            pass


def test_read_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    )
    assert read_index(tmp_path) == {"a": "s1.safetensors", "b": "s2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../etc/passwd"}}))
    with pytest.raises(HeaderError, match="leaves the model directory"):
        read_index(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 3}}))
    with pytest.raises(HeaderError, match="expected a file name"):
        read_index(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(HeaderError, match="weight_map"):
        read_index(tmp_path)


def test_read_index_single_file_and_missing(tmp_path):
    with pytest.raises(HeaderError, match="no model.safetensors.index.json"):
        read_index(tmp_path)
    _write(tmp_path / "model.safetensors", _ok_header(), b"\0" * 12)
    assert read_index(tmp_path) == {"x": "model.safetensors"}
