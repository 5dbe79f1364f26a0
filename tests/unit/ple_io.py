"""What this machine's kernel and file system offer the PLE table's I/O paths, probed once.

The PLE tests skip an `io=uring` / `io=direct` case only when that path is really unavailable
here (io_uring refused by the kernel or a seccomp profile; O_DIRECT refused by the file system),
with the probe's own error as the reason. Any other failure to open a table fails the test:
`io=mmap` (the path that runs under Docker's default seccomp) never skips.
"""

from __future__ import annotations

import functools
import os

import pytest


@functools.lru_cache(maxsize=None)
def uring_missing() -> str | None:
    """None when io_uring works here, else why not."""
    try:
        from flash_vllm.ple.uring import Ring

        ring = Ring(8)
    except (OSError, ImportError) as e:
        return f"io_uring unavailable on this machine ({e})"
    close = getattr(ring, "close", None)
    if close:
        close()
    return None


@functools.lru_cache(maxsize=None)
def _direct_missing_in(folder: str) -> str | None:
    probe = os.path.join(folder, ".odirect-probe")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        os.close(fd)
    except (OSError, AttributeError) as e:
        return f"O_DIRECT unavailable on the file system of {folder} ({e})"
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return None


def direct_missing(folder) -> str | None:
    """None when io=direct can work for files in `folder`, else why not."""
    return uring_missing() or _direct_missing_in(os.fspath(folder))


def skip_unless_available(io: str, folder) -> None:
    """Skip (with the probe's reason) only when `io` cannot work here; never for mmap/auto."""
    reason = {"uring": uring_missing, "direct": lambda: direct_missing(folder)}.get(io, lambda: None)()
    if reason:
        pytest.skip(reason)
