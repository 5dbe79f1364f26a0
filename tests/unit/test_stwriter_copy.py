"""PositionalWriter.copy_into's fallback (no copy_file_range: another file system, an old kernel)
must finish short writes instead of leaving a hole that close() would only report later."""

import os

from safetensors.numpy import load_file

from flash_cli.checkpoint import stwriter
from flash_cli.checkpoint.stwriter import Entry, PositionalWriter


def test_copy_into_fallback_finishes_short_pwrites(tmp_path, monkeypatch):
    payload = os.urandom(3 * 4096 + 10)
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 100 + payload)
    entries = [Entry("a", "U8", (len(payload),), len(payload))]
    real_pwrite = os.pwrite
    calls = []

    def no_cfr(*a, **k):
        raise OSError(18, "EXDEV")

    def short_pwrite(fd, data, offset):  # at most 1000 bytes per call, like a signal-interrupted write
        calls.append(len(data))
        return real_pwrite(fd, bytes(memoryview(data)[:1000]), offset)

    monkeypatch.setattr(stwriter.os, "copy_file_range", no_cfr)
    monkeypatch.setattr(stwriter, "COPY_CHUNK", 4096)
    w = PositionalWriter(tmp_path / "out.safetensors", entries)
    monkeypatch.setattr(stwriter.os, "pwrite", short_pwrite)
    fd = os.open(src, os.O_RDONLY)
    try:
        w.copy_into("a", fd, 100)
    finally:
        os.close(fd)
    monkeypatch.setattr(stwriter.os, "pwrite", real_pwrite)
    w.close()
    assert max(calls) > 1000  # the writer asked for more than one call could take
    assert load_file(tmp_path / "out.safetensors")["a"].tobytes() == payload
