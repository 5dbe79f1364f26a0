"""Writer.copy_range's fallback (no copy_file_range) must finish short os.write calls instead of
silently dropping the rest of the chunk (issue 14)."""

import os

from safetensors.numpy import load_file

from flash_cli.checkpoint import stwriter
from flash_cli.checkpoint.stwriter import Entry, Writer


def test_copy_range_fallback_finishes_short_writes(tmp_path, monkeypatch):
    payload = os.urandom(3 * 4096 + 10)
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 100 + payload)
    entries = [Entry("a", "U8", (len(payload),), len(payload))]
    real_write = os.write
    asked = []

    def no_cfr(*a, **k):
        raise OSError(18, "EXDEV")

    def short_write(fd, data):  # at most 1000 bytes per call, like a signal-interrupted write
        asked.append(len(data))
        return real_write(fd, bytes(memoryview(data)[:1000]))

    monkeypatch.setattr(stwriter.os, "copy_file_range", no_cfr)
    monkeypatch.setattr(stwriter, "COPY_CHUNK", 4096)
    w = Writer(tmp_path / "out.safetensors", entries)
    monkeypatch.setattr(stwriter.os, "write", short_write)
    fd = os.open(src, os.O_RDONLY)
    try:
        w.copy_range(fd, 100, len(payload))
    finally:
        os.close(fd)
    monkeypatch.setattr(stwriter.os, "write", real_write)
    w.close()
    assert max(asked) > 1000  # the writer asked for more than one call could take
    assert os.path.getsize(tmp_path / "out.safetensors") == os.path.getsize(src) - 100 + len(stwriter.header_bytes(entries, None))
    assert load_file(tmp_path / "out.safetensors")["a"].tobytes() == payload
