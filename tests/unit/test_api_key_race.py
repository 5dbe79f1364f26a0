"""ensure_api_key under real concurrency (issue 34): 16 processes released at once by a barrier
must all come back with the same key, exactly one of them having created it (the repro handed
out up to 5 different keys: each process wrote its own and renamed it over the others')."""

from __future__ import annotations

import multiprocessing
import os
import stat

import pytest

from flash_cli import state

PROCS = 16
ROUNDS = 6


def _worker(barrier, out, name: str) -> None:
    barrier.wait()
    path, created = state.ensure_api_key(name)
    out.put((os.getpid(), path.read_text().strip(), created))


@pytest.mark.timeout(120)
def test_sixteen_processes_get_one_key():
    ctx = multiprocessing.get_context("fork")  # real processes, the test's HOME/XDG_STATE_HOME inherited
    for rnd in range(ROUNDS):
        name = f"race{rnd}"
        barrier, out = ctx.Barrier(PROCS), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(barrier, out, name)) for _ in range(PROCS)]
        for p in procs:
            p.start()
        got = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert len({pid for pid, _, _ in got}) == PROCS  # sixteen distinct processes answered
        keys = {key for _, key, _ in got}
        path = state.api_key_path(name)
        assert keys == {path.read_text().strip()}, f"round {rnd}: {len(keys)} different keys handed out"
        assert next(iter(keys)).startswith("sk-flash-")
        assert sum(created for _, _, created in got) == 1, f"round {rnd}: {[c for _, _, c in got]}"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # no temp left behind


def test_an_empty_key_file_is_replaced_and_a_key_kept():
    path = state.api_key_path("empty")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n")
    again, created = state.ensure_api_key("empty")
    key = again.read_text().strip()
    assert created and key.startswith("sk-flash-")
    assert state.ensure_api_key("empty") == (path, False) and path.read_text().strip() == key
