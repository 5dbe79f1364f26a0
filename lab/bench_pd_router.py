#!/usr/bin/env python3
"""Load through the pd router vs straight to the decode server, in one run (issue 34).

C clients, each sending R streaming completions one after another, each on a new connection (as
the audit's run: 200 x 5 reset 49 of 1,000 connections on the old router). The servers are the
faithful fakes of vLLM's prefill and decode servers (tests/fakes/pd.py: real HTTP, SSE, ~10 ms per
token) in their own process; the router is `python -m flash_vllm.pdrouter` in its own, with an API
key, as deployed. "direct" sends the decode server the request it gets from the router (the
client's body plus complete kv_transfer_params), so both sides do the same decode work; the
router adds the prefill leg and the relay. Latency is to the last byte of the stream; an error is
a refused/reset connection, a timeout, a status other than 200 or a stream without `[DONE]`.

`--workers 1,2` runs the router once per worker count (`pdrouter --workers N`), each right after
its own direct run, all in one invocation so the counts see the same machine; the summary keys
are `direct`/`router` for one count, `w1`, `w2`, ... (each with its own direct, router and ratios)
for several. The router's CPU is the supervisor's plus every worker's.

Prints one table (p50/p90/p99/max per side and the router/direct ratios) and, with --json PATH,
writes every latency. Target: 0 errors, router p99 <= 1.1 x direct p99. Exit 1 on any error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-bench-0123456789"
WORDS = 10


def serve_fakes(procs: int = 1, token_gap_s: float = 0.01) -> None:
    """--fakes: the prefill and decode fakes until stdin closes, in `procs` processes: the listening
    sockets are bound once, then the process forks (before any thread starts) and every copy serves
    both on them, the kernel handing each accepted connection to one. One process is one GIL: at 200
    clients it held a full core in every device run (2026-12-05), so its queue, not the router's,
    set the tail. The bench's direct requests carry complete params and the decode fake has no
    peer, so the copies share no state a request needs."""
    from tests.fakes.pd import FakeServer  # run from the repository root (python3 -m lab.bench_pd_router)

    p = FakeServer("prefill", KEY)
    d = FakeServer("decode", KEY)  # no peer: direct requests carry complete params of their own
    d.token_gap_s = token_gap_s
    parent = os.getpid()
    for _ in range(procs - 1):
        if os.fork() == 0:
            break  # a copy: it serves below and ends at stdin's EOF, as the parent does
    p.start()
    d.start()
    if os.getpid() == parent:
        print(json.dumps({"prefill": p.url, "decode": d.url}), flush=True)
    sys.stdin.read()


def direct_params() -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": "bench", "remote_request_id": "cmpl-bench-0", "remote_host": "10.0.0.1",
            "remote_port": 5600, "tp_size": 1}


async def load(url: str, body: dict, clients: int, rounds: int, timeout: float) -> dict:
    import aiohttp

    lat: list[float] = []
    errors: dict[str, int] = {}
    samples: list[str] = []  # the first few error answers, for the record
    data = json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # a new connection per request
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        start = asyncio.Event()

        async def client() -> None:
            await start.wait()
            for _ in range(rounds):
                t = time.perf_counter()
                try:
                    async with session.post(url + "/v1/completions", data=data, headers=headers) as resp:
                        text = await resp.read()
                    if resp.status != 200:
                        why = f"HTTP {resp.status}"
                        if len(samples) < 5:
                            samples.append(text[:300].decode("utf-8", "replace"))
                    elif b"data: [DONE]" not in text:
                        why = "stream without [DONE]"
                    else:
                        lat.append(time.perf_counter() - t)
                        continue
                except Exception as exc:  # noqa: BLE001 - every failure is counted by kind
                    why = type(exc).__name__
                errors[why] = errors.get(why, 0) + 1

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        t0 = time.perf_counter()
        start.set()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return {"latencies": lat, "errors": sum(errors.values()), "error_kinds": errors, "error_samples": samples, "wall_s": wall,
            "requests": clients * rounds}


def _load_share(args: tuple) -> dict:
    return asyncio.run(load(*args))


def load_split(url: str, body: dict, clients: int, rounds: int, timeout: float, procs: int) -> dict:
    """load() over `procs` client processes (clients split evenly): one asyncio loop is one core,
    and at 200 clients it was ~50-80% busy, its own queue part of every latency. The processes
    fork at once and start sending as they come up (a few ms apart)."""
    if procs == 1:
        return asyncio.run(load(url, body, clients, rounds, timeout))
    import multiprocessing

    shares = [clients // procs + (i < clients % procs) for i in range(procs)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        parts = pool.map(_load_share, [(url, body, n, rounds, timeout) for n in shares if n])
    kinds: dict[str, int] = {}
    for part in parts:
        for k, v in part["error_kinds"].items():
            kinds[k] = kinds.get(k, 0) + v
    return {"latencies": [x for part in parts for x in part["latencies"]], "errors": sum(kinds.values()),
            "error_kinds": kinds, "error_samples": [x for part in parts for x in part["error_samples"]][:5],
            "wall_s": max(part["wall_s"] for part in parts), "requests": sum(part["requests"] for part in parts)}


def child_pids(pid: int) -> list[int]:
    """The live (not zombie) children of pid, from /proc/*/stat (field 4: the parent)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children so far: /proc/PID/stat fields 14
    and 15, plus the same of every live child (the router's workers; none restart during a run)."""
    def own(p: int) -> float:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a child gone since it was listed
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own(pid) + sum(own(c) for c in child_pids(pid))


def client_cpu_s() -> float:
    """This process's CPU plus that of its ended children (load_split's client processes)."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def measured(pids: dict, run) -> dict:
    before = {k: cpu_s(v) for k, v in pids.items()}
    own = client_cpu_s()
    out = run()
    out["cpu_s"] = {**{k: round(cpu_s(v) - before[k], 3) for k, v in pids.items()},
                    "client": round(client_cpu_s() - own, 3)}
    return out


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def summary(r: dict) -> dict:
    lat = r["latencies"]
    return {"requests": r["requests"], "errors": r["errors"], "error_kinds": r["error_kinds"],
            "error_samples": r["error_samples"], "cpu_s": r["cpu_s"],
            "wall_s": round(r["wall_s"], 3), "p50": quantile(lat, 0.5), "p90": quantile(lat, 0.9),
            "p99": quantile(lat, 0.99), "max": max(lat) if lat else float("nan"),
            "mean": statistics.fmean(lat) if lat else float("nan")}


def start_router(fakes: dict, log: Path, workers: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "VLLM_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "flash_vllm.pdrouter", "--host", "127.0.0.1", "--port", "0",
                             "--workers", str(workers), "--prefill", fakes["prefill"], "--decode", fakes["decode"]],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env, cwd=ROOT)
    deadline = time.monotonic() + 30
    while not (m := re.search(r"listening on (\S+):(\d+);", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the router did not start: {log.read_text()}")
        time.sleep(0.05)
    return proc, f"http://{m.group(1)}:{m.group(2)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request before it is an error")
    ap.add_argument("--workers", default="1", metavar="N[,N...]",
                    help="router worker processes (pdrouter --workers); several: one router run per count")
    ap.add_argument("--fake-procs", type=int, default=1, metavar="N",
                    help="processes serving the prefill and decode fakes (one GIL each; 1: as every run before "
                         "2026-12-05 evening, whose fakes held one core at 200 clients)")
    ap.add_argument("--client-procs", type=int, default=1, metavar="N",
                    help="client processes the --clients are split over (1: one asyncio loop, as before)")
    ap.add_argument("--tokens", type=int, default=WORDS, metavar="N",
                    help=f"tokens the decode fake streams per request (default {WORDS})")
    ap.add_argument("--token-ms", type=float, default=10.0, metavar="MS",
                    help="milliseconds between the decode fake's tokens (default 10: instant next to a real "
                         "server; a Spark serving many streams spaces its tokens far more)")
    ap.add_argument("--json", metavar="PATH", help="write the summary and every latency here")
    ap.add_argument("--fakes", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    for name in ("fake_procs", "client_procs"):
        if not 1 <= getattr(ns, name) <= 64:
            ap.error(f"--{name.replace('_', '-')} {getattr(ns, name)}: between 1 and 64")
    if not 1 <= ns.tokens <= 4096:
        ap.error(f"--tokens {ns.tokens}: between 1 and 4096")
    if not 0 <= ns.token_ms <= 10_000:  # nan fails both comparisons
        ap.error(f"--token-ms {ns.token_ms}: between 0 and 10000")
    if ns.fakes:
        serve_fakes(ns.fake_procs, ns.token_ms / 1000)
        return 0
    import tempfile

    try:
        counts = [int(w) for w in ns.workers.split(",")]
    except ValueError:
        ap.error(f"--workers {ns.workers!r}: comma-separated integers, e.g. 1,2")
    if any(w < 1 for w in counts):
        ap.error("--workers: each count at least 1 (0, the router's auto, would hide what was measured)")
    fk = subprocess.Popen([sys.executable, "-m", "lab.bench_pd_router", "--fakes", "--fake-procs", str(ns.fake_procs),
                           "--token-ms", repr(ns.token_ms)],
                          stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, cwd=ROOT)
    client = {"model": "m", "prompt": "hi", "max_tokens": ns.tokens, "stream": True}
    direct = {**client, "kv_transfer_params": direct_params()}
    results: dict[int, dict] = {}
    try:
        fakes = json.loads(fk.stdout.readline())
        for w in counts:
            log = Path(tempfile.mkdtemp(prefix="bench-pd-")) / "router.log"
            router, url = start_router(fakes, log, w)
            try:
                # warm both paths (connection pools, first imports, every worker) outside the measurement
                asyncio.run(load(url, client, 10 * w, 2, ns.timeout))
                asyncio.run(load(fakes["decode"], direct, 10, 2, ns.timeout))
                pids = {"router": router.pid, "fakes": fk.pid}
                # direct right before its router run: both halves of a ratio see the same load average
                cp = ns.client_procs
                raw = {"direct": measured(pids, lambda: load_split(fakes["decode"], direct, ns.clients, ns.rounds,
                                                                   ns.timeout, cp)),
                       "router": measured(pids, lambda: load_split(url, client, ns.clients, ns.rounds, ns.timeout, cp))}
            finally:
                router.terminate()
                router.wait(30)
            results[w] = raw
    finally:
        fk.stdin.close()
        fk.wait(30)
    setup = {"clients": ns.clients, "rounds": ns.rounds, "tokens_per_stream": ns.tokens, "token_ms": ns.token_ms,
             "workers": counts,
             "fake_procs": ns.fake_procs, "client_procs": ns.client_procs,
             "cores": os.cpu_count(), "loadavg_before": os.getloadavg()[0], "machine": platform.machine(),
             "python": platform.python_version(), "command": " ".join(["python3 -m lab.bench_pd_router", *sys.argv[1:]])}
    runs = {}
    for w, raw in results.items():
        out = {k: summary(v) for k, v in raw.items()}
        out["workers"] = w
        out["ratio_p50"] = out["router"]["p50"] / out["direct"]["p50"]
        out["ratio_p99"] = out["router"]["p99"] / out["direct"]["p99"]
        out["router_cpu_ms_per_request"] = round(1000 * out["router"]["cpu_s"]["router"] / out["router"]["requests"], 3)
        runs[w] = (out, raw)
        print(f"--workers {w}")
        print(f"{'':8} {'requests':>8} {'errors':>6} {'p50 s':>8} {'p90 s':>8} {'p99 s':>8} {'max s':>8} {'wall s':>7}")
        for k in ("direct", "router"):
            s = out[k]
            print(f"{k:8} {s['requests']:>8} {s['errors']:>6} {s['p50']:>8.3f} {s['p90']:>8.3f} {s['p99']:>8.3f} "
                  f"{s['max']:>8.3f} {s['wall_s']:>7.2f}" + (f"  {s['error_kinds']}" if s["errors"] else ""))
            print(f"{'':8} CPU seconds: {s['cpu_s']}")
            for sample in s["error_samples"]:
                print(f"    {sample}")
        print(f"router/direct: p50 {out['ratio_p50']:.3f}x, p99 {out['ratio_p99']:.3f}x (target p99 <= 1.1x, 0 errors);"
              f" router CPU {out['router_cpu_ms_per_request']:.2f} ms/request")
    if len(runs) == 1:  # the one-count shape as before: direct, router, ratios at the top
        (out, raw), = runs.values()
        doc = {**out, "setup": setup, "latencies": {k: v["latencies"] for k, v in raw.items()}}
    else:
        doc = {"setup": setup, **{f"w{w}": {**out, "latencies": {k: v["latencies"] for k, v in raw.items()}}
                                  for w, (out, raw) in runs.items()}}
    if ns.json:
        Path(ns.json).write_text(json.dumps(doc) + "\n")
    return 1 if any(out["router"]["errors"] or out["direct"]["errors"] for out, _ in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
