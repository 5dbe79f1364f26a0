"""lab/bench_pd_router.py's process options: the fakes and the clients spread over processes (on the
device's 16 cores one fakes process held a full core at 200 clients, so its queue set the tail)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fakes_and_clients_over_several_processes(tmp_path):
    out = tmp_path / "b.json"
    res = subprocess.run([sys.executable, "-m", "lab.bench_pd_router", "--clients", "12", "--rounds", "2",
                          "--fake-procs", "3", "--client-procs", "2", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    assert (doc["setup"]["fake_procs"], doc["setup"]["client_procs"]) == (3, 2)
    for side in ("direct", "router"):
        assert doc[side]["requests"] == 24 and doc[side]["errors"] == 0
        assert len(doc["latencies"][side]) == 24  # both client processes' latencies merged
        assert doc[side]["cpu_s"]["client"] > 0  # the client processes' CPU is counted (they ended)


def test_process_counts_are_bounded():
    res = subprocess.run([sys.executable, "-m", "lab.bench_pd_router", "--fake-procs", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--fake-procs 0: between 1 and 64" in res.stderr
