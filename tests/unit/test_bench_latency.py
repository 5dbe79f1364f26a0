"""lab/bench_latency.py (issue 33, item 2) against a stand-in `vllm` module that serves real HTTP:
a prefix cache shaped like Mamba's align mode under vLLM's default retention (states only at each
prompt's last block boundary and at a junction a later prompt found: docs/PREFIX-CACHE.md), and one
engine loop where a long prefill holds the step, so a decoding stream's gaps grow while it runs.
The harness must read each prompt's hits from vLLM's own counters, keep the second and third
prompt apart, and time the gaps inside the prefill's window."""

from __future__ import annotations

import json

import pytest

from flash_cli.errors import ConfigError
from lab import bench_latency as bl
from lab import bench_recipe as br
from tests.fakes import vllm_cli


FAKE_MAIN = r'''
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
chunked = "--long-prefill-token-threshold" in argv   # the shared profile: long prefills in pieces
BLOCK = 512 if os.environ.get("VLLM_PLUGINS") == "" else 256   # stock caches coarser blocks
seen = []                     # prompts already prefilled
states = set()                # token prefixes whose state is cached (align mode: block boundaries only)
counts = {"hits": 0, "queries": 0}
engine = threading.Lock()     # one step at a time, as one engine core
def common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
def cached(prompt):
    p = (len(prompt) - 1) // BLOCK * BLOCK
    while p > 0 and tuple(prompt[:p]) not in states:
        p -= BLOCK
    return p
def keep(prompt):
    # the prompt's last block boundary; the junction with an earlier prompt, where its prefill stopped
    states.add(tuple(prompt[:(len(prompt) - 1) // BLOCK * BLOCK]))
    for old in seen:
        states.add(tuple(prompt[:common(old, prompt) // BLOCK * BLOCK]))
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
        keep(prompt)
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
    vllm_cli.install(tmp_path, monkeypatch, FAKE_MAIN)
    d = tmp_path / "b"
    assert br.main(["prepare", str(d), "--ple-rows", "100000"]) == 0
    out = tmp_path / "raw.jsonl"
    assert bl.main(["run", str(d), "--configs", "stock,shared,shared-400", "--out", str(out), "--prefixes", "256,1024,2048",
                    "--tails", "32,600", "--prefill", "20000", "--itl-tokens", "200", "--repeats", "1",
                    "--port", "18830", "--boot-timeout", "120", "--set", "GPU_MEM=0.7", "--itl-only", "shared-400"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    booted = [r for r in rows if r.get("event") == "booted"]
    assert [r["label"] for r in booted] == ["stock", "shared", "shared-400"]
    # --itl-only: the sweep's server measures the gaps and no prefix
    assert {r["study"] for r in rows if r.get("label") == "shared-400" and r.get("study")} == {"itl"}
    # a --set reaches every server's argv and is named; every row carries the GPU field (None here)
    for r in booted:
        argv = r["argv"]
        assert float(argv[argv.index("--gpu-memory-utilization") + 1]) == 0.7
        assert "GPU_MEM=0.7: set for every server of this run (--set)" in r["deviations"]
    assert all("gpu" in r for r in rows)
    prefix = {(r["label"], r["tail_tokens"], r["prefix_tokens"], r["send"]): r for r in rows if r.get("study") == "prefix"}
    assert len(prefix) == 2 * 2 * 3 * bl.SENDS
    # the hits are the server's own counters around each prompt: whole blocks of the prefix
    assert all(prefix[(lb, t, n, 1)]["hit_tokens"] == 0 for lb in ("stock", "shared") for t in (32, 600)
               for n in (256, 1024, 2048))
    assert [prefix[("stock", 32, n, 2)]["hit_tokens"] for n in (256, 1024, 2048)] == [0, 1024, 2048]
    assert prefix[("shared", 32, 256, 2)]["hit_tokens"] == 256
    # a tail past a block: the second prompt misses, the third hits at the junction the second found
    assert [prefix[("stock", 600, n, 2)]["hit_tokens"] for n in (1024, 2048)] == [0, 0]
    assert [prefix[("stock", 600, n, 3)]["hit_tokens"] for n in (1024, 2048)] == [1024, 2048]
    assert all(r["query_tokens"] == r["prefix_tokens"] + r["tail_tokens"] for r in prefix.values())
    itl = {r["label"]: r for r in rows if r.get("study") == "itl"}
    # one 0.4 s prefill step stalls stock's stream; the shared profile's 512-token pieces interleave
    assert itl["stock"]["busy_gaps"] >= 1 and itl["stock"]["busy_max_ms"] > 300
    assert itl["shared"]["busy_gaps"] > 5 and itl["shared"]["busy_max_ms"] < itl["stock"]["busy_max_ms"] / 2
    # the stream outlasts the prompt (vLLM cuts a prompt into pieces only while another request runs),
    # and busy_sum_ms is the counted gaps' sum
    for r in itl.values():
        assert r["stream_finished_after_prefill"] is True
        assert r["busy_sum_ms"] >= r["busy_p50_ms"] * r["busy_gaps"] / 2
    rep = bl.report(rows)
    assert rep["stock"]["hits_from_tokens"] == {"32": {"send2": 1024, "send3": 1024},
                                                "600": {"send2": None, "send3": 1024}}
    assert rep["shared"]["hits_from_tokens"]["32"] == {"send2": 256, "send3": 256}
    assert rep["stock"]["prefix"]["600"]["2048"]["send3"]["hit_tokens"] == 2048
    assert rep["stock"]["hit_goal_met"]  # by the third prompt, from 2,048 tokens on
    assert rep["stock"]["itl"]["p99_ratio"] > rep["shared"]["itl"]["p99_ratio"]
    assert bl.main(["report", str(out), "--json", str(tmp_path / "s.json"), "--png", str(tmp_path / "l.png")]) == 0
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tail 600: hits from None tokens on the second prompt, 1024 on the third" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text()) == rep
    assert "prefix" not in rep["shared-400"] and rep["shared-400"]["itl"]["repeats"] == 1
    # a run of --itl-only servers alone (latency48 run3): one panel, and each line names its server
    only = tmp_path / "itl-only.jsonl"
    only.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("label") == "shared-400"))
    assert bl.main(["report", str(only), "--png", str(tmp_path / "i.png")]) == 0
    assert (tmp_path / "i.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.startswith("shared-400: (no prefix study)\n  ITL p50 ")
    with pytest.raises(SystemExit, match="--itl-only shared-200: not in --configs stock"):
        bl.main(["run", str(d), "--configs", "stock", "--out", str(tmp_path / "x.jsonl"), "--itl-only", "shared-200"])


def test_a_bad_set_fails_before_any_server_boots(tmp_path, monkeypatch):
    vllm_cli.install(tmp_path, monkeypatch, FAKE_MAIN)
    d = tmp_path / "b"
    assert br.main(["prepare", str(d), "--ple-rows", "100000"]) == 0
    out = tmp_path / "raw.jsonl"
    with pytest.raises(ConfigError, match="GPU_MEM='nope' is not valid: expected a number"):
        bl.main(["run", str(d), "--configs", "stock,shared", "--out", str(out), "--port", "18831",
                 "--set", "GPU_MEM=nope"])
    assert not out.exists() or out.read_text() == ""
    assert not list(tmp_path.glob("latency-*.log"))


def test_the_busy_stream_decodes_until_the_prompt_is_done_then_closes(tmp_path, monkeypatch):
    """The prompt outlasts the idle stream's length here (50 tokens at 2 ms, a 0.8 s prefill in 512-token
    pieces): the busy stream decodes past it, and the client closes it ITL_LEAD chunks after the
    prompt's first token, long before the cap."""
    vllm_cli.install(tmp_path, monkeypatch, FAKE_MAIN)
    d = tmp_path / "b"
    assert br.main(["prepare", str(d), "--ple-rows", "100000"]) == 0
    out = tmp_path / "raw.jsonl"
    chunks = []
    real = bl.stream

    def counted(url, prompt, tokens, stamps=None, stop=None):
        got = real(url, prompt, tokens, stamps, stop)
        chunks.append((tokens, got["chunks"], stop is not None))
        return got

    monkeypatch.setattr(bl, "stream", counted)
    assert bl.main(["run", str(d), "--configs", "shared", "--out", str(out), "--prefill", "40000", "--itl-tokens", "50",
                    "--repeats", "1", "--port", "18832", "--boot-timeout", "120", "--itl-only", "shared"]) == 0
    itl = [json.loads(x) for x in out.read_text().splitlines() if '"itl"' in x][0]
    assert itl["stream_finished_after_prefill"] is True
    busy = [c for c in chunks if c[2]]
    assert len(busy) == 1 and busy[0][0] == bl.ITL_CAP
    assert 50 < busy[0][1] < bl.ITL_CAP // 4  # past the idle length, closed long before the cap


def test_percentile_and_gaps():
    assert bl.gaps_ms([0.0, 0.001, 0.004]) == [1.0, 3.0000000000000004] or bl.gaps_ms([0.0, 0.001, 0.004])[1] > 2.99
    assert bl.pct([5, 1, 3], 0.5) == 3 and bl.pct([1, 2, 3, 100], 0.99) == 100
