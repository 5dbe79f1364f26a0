"""lab/bench_latency.py (issue 33, item 2) against a stand-in `vllm` module that serves real HTTP:
a prefix cache that hits only from a block boundary (as Mamba's align mode caches whole blocks), and
one engine loop where a long prefill holds the step, so a decoding stream's gaps grow while it runs.
The harness must read the hits from vLLM's own counters and time the gaps inside the prefill's window."""

from __future__ import annotations

import json
from pathlib import Path

from lab import bench_latency as bl
from lab import bench_recipe as br

ROOT = Path(__file__).resolve().parents[2]

FAKE_MAIN = r'''
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
chunked = "--long-prefill-token-threshold" in argv   # the shared profile: long prefills in pieces
BLOCK = 512 if os.environ.get("VLLM_PLUGINS") == "" else 256   # stock caches coarser blocks
seen = []                     # prompts already prefilled (the cache)
counts = {"hits": 0, "queries": 0}
engine = threading.Lock()     # one step at a time, as one engine core
def cached(prompt):
    best = 0
    for old in seen:
        n = 0
        for a, b in zip(old, prompt):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return (best // BLOCK) * BLOCK
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        if self.path == "/health":
            body = b"ok"
        else:
            body = ("# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{model_name=\"bench\"} %d\n"
                    "# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{model_name=\"bench\"} %d\n"
                    % (counts["hits"], counts["queries"])).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = req["prompt"]
        hit = cached(prompt)
        counts["hits"] += hit; counts["queries"] += len(prompt)
        seen.append(prompt)
        todo = len(prompt) - hit
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
        def send(obj):
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data)); self.wfile.flush()
        piece = 512 if chunked else todo     # tokens of prefill per step
        while todo > 0:
            with engine:
                n = min(piece, todo); time.sleep(n * 2e-5); todo -= n
            time.sleep(0.001)  # the lock is not fair: let a waiting decode step in between pieces
        for _ in range(req["max_tokens"]):
            with engine:
                time.sleep(0.002)
            send({"choices": [{"text": "x"}]})
        send(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n"); self.wfile.flush()
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_prefix_hits_and_gaps_under_a_prefill(tmp_path, monkeypatch, capsys):
    site = tmp_path / "site"
    main = site / "vllm" / "entrypoints" / "cli"
    main.mkdir(parents=True)
    for pkg in (site / "vllm", site / "vllm" / "entrypoints", main):
        (pkg / "__init__.py").write_text("")
    (main / "main.py").write_text(FAKE_MAIN)
    monkeypatch.setenv("PYTHONPATH", f"{site}:{ROOT / 'src'}")
    d = tmp_path / "b"
    assert br.main(["prepare", str(d), "--ple-rows", "100000"]) == 0
    out = tmp_path / "raw.jsonl"
    assert bl.main(["run", str(d), "--configs", "stock,shared", "--out", str(out), "--prefixes", "256,1024,2048",
                    "--prefill", "20000", "--itl-tokens", "200", "--repeats", "1", "--port", "18830",
                    "--boot-timeout", "120"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["label"] for r in rows if r.get("event") == "booted"] == ["stock", "shared"]
    prefix = {(r["label"], r["prefix_tokens"]): r for r in rows if r.get("study") == "prefix"}
    # the hits are the server's own counters around the second request: whole blocks of the prefix
    assert prefix[("stock", 256)]["hit_tokens"] == 0 and prefix[("stock", 1024)]["hit_tokens"] == 1024
    assert prefix[("shared", 256)]["hit_tokens"] == 256 and prefix[("shared", 2048)]["hit_tokens"] == 2048
    assert all(r["query_tokens"] == r["prefix_tokens"] + bl.TAIL for r in prefix.values())
    itl = {r["label"]: r for r in rows if r.get("study") == "itl"}
    # one 0.4 s prefill step stalls stock's stream; the shared profile's 512-token pieces interleave
    assert itl["stock"]["busy_gaps"] >= 1 and itl["stock"]["busy_max_ms"] > 300
    assert itl["shared"]["busy_gaps"] > 5 and itl["shared"]["busy_max_ms"] < itl["stock"]["busy_max_ms"] / 2
    rep = bl.report(rows)
    assert rep["stock"]["hits_from_tokens"] == 1024 and rep["shared"]["hits_from_tokens"] == 256
    assert rep["stock"]["itl"]["p99_ratio"] > rep["shared"]["itl"]["p99_ratio"]
    assert bl.main(["report", str(out), "--json", str(tmp_path / "s.json")]) == 0
    assert "hits from 1024 tokens" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text()) == rep


def test_percentile_and_gaps():
    assert bl.gaps_ms([0.0, 0.001, 0.004]) == [1.0, 3.0000000000000004] or bl.gaps_ms([0.0, 0.001, 0.004])[1] > 2.99
    assert bl.pct([5, 1, 3], 0.5) == 3 and bl.pct([1, 2, 3, 100], 0.99) == 100
