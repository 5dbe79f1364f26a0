"""Malformed headers and index files: a clean error naming the file, never a crash or a huge
allocation; plus a seeded fuzz run over the safetensors header parser (flash_common.stheader)."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from fakes import ckpt
from flash_cli.checkpoint import verify
from flash_common.stheader import HeaderError, MAX_HEADER_BYTES, parse_header, read_header

ROOT = Path(__file__).resolve().parents[2]
FUZZ_ITERS = int(os.environ.get("FLASH_FUZZ_ITERS", "6000"))
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}  # this checkout, whatever is installed


def _file(tmp_path, header: bytes, data_len: int, name="x.safetensors") -> Path:
    p = tmp_path / name
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + data_len)
    return p


@pytest.mark.parametrize("content,needle", [
    (b"", "too short"),
    (b"\x01\x00", "too short"),
    (struct.pack("<Q", 2**63) + b"{}", "cap"),
    (struct.pack("<Q", 1000) + b"{}", "past the end"),
    (struct.pack("<Q", 4) + b"\xff\xfe{}", "UTF-8"),
    (struct.pack("<Q", 2) + b"[]", "expected an object"),
    (struct.pack("<Q", 8) + b'{"a":1} ', "entry is a int"),
])
def test_malformed_header_files(tmp_path, content, needle):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(content)
    with pytest.raises(HeaderError) as err:
        read_header(p)
    assert needle in str(err.value) and str(p) in str(err.value)


def test_huge_declared_sizes_allocate_nothing(tmp_path):
    hdr = json.dumps({"t": {"dtype": "F32", "shape": [2**62, 2**62, 2**62], "data_offsets": [0, 16]}}).encode()
    p = _file(tmp_path, hdr, 16)
    tracemalloc.start()
    with pytest.raises(HeaderError, match="needs"):
        read_header(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000
    big = tmp_path / "big.safetensors"  # a sparse 200 MB "header": refused before reading it
    with open(big, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(MAX_HEADER_BYTES + 100)
    tracemalloc.start()
    with pytest.raises(HeaderError, match="cap"):
        read_header(big)
    assert tracemalloc.get_traced_memory()[1] < 1_000_000
    tracemalloc.stop()


def _snap(tmp_path):
    return ckpt.write_snapshot(tmp_path / "hf", "nvidia")


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def _flash_verify(snap: Path):
    return subprocess.run([sys.executable, "-m", "flash_cli", "verify", "--path", str(snap)],
                          capture_output=True, text=True, cwd=ROOT, env=ENV)


@pytest.mark.parametrize("index,needle", [
    (b"{not json", "not valid JSON"),
    (b'{"weight_map": []}', "weight_map"),
    (b'{"weight_map": {"a": "../../etc/passwd"}}', "leaves the model directory"),
    (b'{"weight_map": {"a": 5}}', "expected a file name"),
    (b"[1,2]", "expected an object"),
])
def test_malformed_index_is_named_cleanly(tmp_path, index, needle):
    snap = _snap(tmp_path)
    _replace(snap / "model.safetensors.index.json", index)
    res = verify.structure(snap)
    assert not res.ok and any(needle in p for p in res.problems), res.problems
    out = _flash_verify(snap)
    assert out.returncode == 1 and needle in out.stdout and "Traceback" not in out.stderr


def test_every_kind_of_damage_is_reported_by_name(tmp_path):
    snap = _snap(tmp_path)
    wm = json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(wm.values()))
    # 1) a dangling shard link, 2) a truncated shard, 3) an index key missing from its header
    os.unlink(os.path.realpath(snap / files[0]))
    real = os.path.realpath(snap / files[1])
    os.truncate(real, os.path.getsize(real) - 1)
    idx = json.loads((snap / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.language_model.layers.0.ghost.weight"] = files[2]
    _replace(snap / "model.safetensors.index.json", json.dumps(idx).encode())
    (snap / "tokenizer.json").unlink()
    out = _flash_verify(snap)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"missing: {files[0]}" in out.stdout
    assert f"{files[1]}: tensor " in out.stdout and "past the data section" in out.stdout, out.stdout
    assert f"{files[2]}: 1 index key(s) not in its header, e.g. model.language_model.layers.0.ghost.weight" in out.stdout
    assert "missing: tokenizer.json" in out.stdout


def test_verify_cli_by_settings_exit_codes(tmp_path):
    snap = _snap(tmp_path)
    cmd = [sys.executable, "-m", "flash_cli", "verify", "--no-profile", f"MODEL={ckpt.NVIDIA}",
           f"HF_CACHE={tmp_path / 'hf'}"]
    ok = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    os.unlink(os.path.realpath(snap / "model-fp8-mtp-ple.safetensors"))
    bad = subprocess.run(cmd + ["--json"], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert bad.returncode == 1
    assert json.loads(bad.stdout)[0]["problems"] == ["missing: model-fp8-mtp-ple.safetensors"]
    none = subprocess.run(cmd[:-1] + [f"HF_CACHE={tmp_path / 'empty'}"], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert none.returncode == 5 and "no snapshot" in none.stderr


# --- fuzz ---------------------------------------------------------------------------------

def _valid(rng: random.Random) -> tuple[bytes, int]:
    pos, obj = 0, {"__metadata__": {"format": "pt"}}
    for i in range(rng.randint(0, 6)):
        dtype = rng.choice(["F32", "BF16", "F8_E4M3", "U8", "I64", "F4"])
        shape = [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]
        n = 1
        for d in shape:
            n *= d
        bits = {"F32": 32, "BF16": 16, "F8_E4M3": 8, "U8": 8, "I64": 64, "F4": 4}[dtype]
        if n * bits % 8:
            shape, n = [2], 2
        nbytes = n * bits // 8
        obj[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    return json.dumps(obj).encode(), pos


EXTREMES = [b"-1", b"0", b"1e400", b"NaN", b"Infinity", b"9" * 5000, b"18446744073709551616", b"null",
            b"true", b'"x"', b"[]", b"{}", b"[0,0]", b"[[[[[[[[[[[[1]]]]]]]]]]]]", b"2.5"]


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        if not b:
            b += b"{"
        i = rng.randrange(len(b))
        if op == 0:
            b[i] = rng.randrange(256)
        elif op == 1:
            del b[i:i + rng.randint(1, 8)]
        elif op == 2:
            b[i:i] = rng.choice(EXTREMES)
        elif op == 3:  # replace a number with an extreme
            j = i
            while j < len(b) and not chr(b[j]).isdigit():
                j += 1
            k = j
            while k < len(b) and chr(b[k]).isdigit():
                k += 1
            b[j:k] = rng.choice(EXTREMES)
        elif op == 4:
            b[i:i] = b"[" * rng.randint(1, 3000)
        else:
            b = b[: rng.randrange(len(b) + 1)]
    return bytes(b)


def test_fuzz_header_parser_only_raises_header_error():
    rng = random.Random(20261130)
    accepted = rejected = 0
    tracemalloc.start()
    for it in range(FUZZ_ITERS):
        raw, data_len = _valid(rng)
        if it % 10:
            raw = _mutate(rng, raw)
        file_size = 8 + len(raw) + data_len + rng.choice([0, 0, 0, -1, 1, rng.randint(-50, 50)])
        tracemalloc.reset_peak()
        try:
            h = parse_header(raw, file_size=max(file_size, 0))
        except HeaderError:
            rejected += 1
        else:
            accepted += 1
            for t in h.tensors.values():  # anything accepted must be loadable as declared
                assert h.data_start <= t.begin <= t.end <= h.file_size
                assert t.nbytes * 8 == t.numel * t.bits
        assert tracemalloc.get_traced_memory()[1] < 50 * len(raw) + 2_000_000, f"iteration {it}"
    tracemalloc.stop()
    assert accepted > FUZZ_ITERS // 20 and rejected > FUZZ_ITERS // 2  # the fuzz reaches both sides


def test_empty_tensor_with_a_huge_dim_is_accepted_like_safetensors_does(tmp_path):
    # found by reviewing the parser against the Rust loader: [10**12, 0] holds 0 bytes
    hdr = json.dumps({"a": {"dtype": "F32", "shape": [10**12, 0], "data_offsets": [0, 0]},
                      "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}).encode()
    h = read_header(_file(tmp_path, hdr, 4))
    assert h.tensors["a"].nbytes == 0 and h.tensors["a"].numel == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "x.safetensors"), "np") as f:
        assert f.get_tensor("a").shape == (10**12, 0)
