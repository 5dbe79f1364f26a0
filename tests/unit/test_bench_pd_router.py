"""lab/bench_pd_router.py's process options: the fakes and the clients spread over processes (on the
device's 16 cores one fakes process held a full core at 200 clients, so its queue set the tail)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench(tmp_path, *args: str) -> dict:
    """Run the bench with these arguments and --json; exit 0 asserted; the JSON it wrote."""
    out = tmp_path / "b.json"
    res = subprocess.run([sys.executable, "-m", "lab.bench_pd_router", *args, "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(out.read_text())


def test_fakes_and_clients_over_several_processes(tmp_path):
    doc = bench(tmp_path, "--clients", "12", "--rounds", "2", "--fake-procs", "3", "--client-procs", "2")
    assert (doc["setup"]["fake_procs"], doc["setup"]["client_procs"]) == (3, 2)
    for side in ("direct", "router"):
        assert doc[side]["requests"] == 24 and doc[side]["errors"] == 0
        assert len(doc["latencies"][side]) == 24  # both client processes' latencies merged
        assert doc[side]["cpu_s"]["client"] > 0  # the client processes' CPU is counted (they ended)


def test_process_counts_are_bounded():
    res = subprocess.run([sys.executable, "-m", "lab.bench_pd_router", "--fake-procs", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--fake-procs 0: between 1 and 64" in res.stderr


def test_the_decode_fake_paces_its_tokens_as_asked(tmp_path):
    """--tokens/--token-ms: a stream of 30 tokens 40 ms apart takes at least 1.2 s on both sides (the
    router adds its prefill leg and relay to the same decode work)."""
    doc = bench(tmp_path, "--clients", "4", "--rounds", "1", "--tokens", "30", "--token-ms", "40")
    assert (doc["setup"]["tokens_per_stream"], doc["setup"]["token_ms"]) == (30, 40.0)
    for side in ("direct", "router"):
        assert doc[side]["errors"] == 0 and min(doc["latencies"][side]) >= 30 * 0.040 - 0.01, doc[side]


def test_pacing_is_bounded():
    for args, why in ((["--token-ms", "nan"], "--token-ms nan: between 0 and 10000"),
                      (["--tokens", "0"], "--tokens 0: between 1 and 4096")):
        res = subprocess.run([sys.executable, "-m", "lab.bench_pd_router", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and why in res.stderr, res.stderr


def test_the_plot_reads_both_result_shapes(tmp_path):
    """lab/plot_pd_router.py's rows: several worker counts (w1, w2, ...) or one (ratios at the top)."""
    sys.path.insert(0, str(ROOT))
    from lab.plot_pd_router import rows

    many = ROOT / "benchmarks/pd-router/paced-2core/p64-run1.json"
    doc = json.loads(many.read_text())
    got = rows([many])
    assert [r["workers"] for r in got] == [1, 2] and {r["pacing"] for r in got} == {"64 tokens × 30 ms"}
    assert got[1]["excess_p99"] == doc["w2"]["router"]["p99"] - doc["w2"]["direct"]["p99"]
    one = tmp_path / "one.json"  # the one-count shape: no w1 key, tokens_per_stream only (before --token-ms)
    one.write_text(json.dumps({**doc["w1"], "setup": {**doc["setup"], "workers": [1], "token_ms": None} |
                               {"tokens_per_stream": 10}}))
    (r,) = rows([one])
    assert r["workers"] == 1 and r["ratio_p99"] == doc["w1"]["ratio_p99"]
