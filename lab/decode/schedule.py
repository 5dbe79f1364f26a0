"""When each server runs and is measured: `matrix` boots every config side by side (fixed KV pools)
and measures them in turn, rotating the order each repeat and level so a compared pair shares one
window of the machine's noise; `serve_run` runs one config alone; `run_cmd` measures a server
someone else started."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from flash_common.provenance import tree_commit  # stdlib only

from lab.decode import client, model, servers

ROOT = Path(__file__).resolve().parents[2]


def serve_run(args) -> int:
    d = Path(args.dir).resolve()
    spec = servers.server_plan(d, args.port)[args.config]
    url = f"http://127.0.0.1:{args.port}"
    log = open_server_log(args.log or f"{args.out}.{args.config}.log", spec)
    t0 = time.monotonic()
    proc = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        servers.wait_health(url, proc, args.boot_timeout)
        boot = time.monotonic() - t0
        meta = {"label": args.config, "event": "booted", "boot_s": round(boot, 1), "argv": spec["argv"], "env": spec["env"]}
        client.jsonl_sink(args.out)(meta)
        print(json.dumps(meta), flush=True)
        client.measure(url, args.config, client.parse_levels(args.levels), args.tokens, args.repeats, client.jsonl_sink(args.out))
    finally:
        servers.stop_all({args.config: proc})
    return 0


def tree_measured() -> str:
    """The tree measured (FLASH_E2E_COMMIT, else this checkout's short HEAD), as the e2e tier names it."""
    return tree_commit(ROOT, short=True)


def open_server_log(path, spec: dict, mode: str = "w"):
    """A server's log, opened for the child to write, that first names what it is a log of: the
    commit measured, the start time and the argv. A committed log then says its own provenance
    (before 2026-12-07 only the raw rows and phases.log did)."""
    import shlex

    fh = open(path, mode)  # noqa: SIM115 - the child owns it
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fh.write(f"# flash lab server log: commit {tree_measured()}, started {stamp}\n"
             f"# argv: {shlex.join(spec['argv'])}\n")
    fh.flush()
    return fh


def matrix(args) -> int:
    """All configurations booted side by side (fixed KV pools), then measured one server at a time:
    at each concurrency the configs back to back, the order rotated every repeat and level, so a
    pair compared by `paired` shares one window of this machine's noise; idle servers do not touch
    the GPU. Raw rows carry the model's layer count (meta.json)."""
    import random

    d = Path(args.dir).resolve()
    meta = json.loads((d / "meta.json").read_text())
    configs, levels = servers.parse_configs(args.configs), client.parse_levels(args.levels)
    plan = servers.server_plan(d, args.port, side_by_side=True)
    sink = client.jsonl_sink(args.out)
    logs = Path(args.logs or Path(args.out).parent)
    logs.mkdir(parents=True, exist_ok=True)
    extra = {"layers": meta.get("layers", model.LAYERS), "quant": meta.get("quant"), "ple_rows": meta.get("ple_rows"),
             "commit": tree_measured()}  # every raw row names the tree it measured
    t0, deadline = time.monotonic(), time.monotonic() + args.deadline
    procs, urls, booted = {}, {}, {}
    try:
        for c in configs:
            spec = plan[c]
            port = int(spec["argv"][spec["argv"].index("--port") + 1])
            urls[c] = f"http://127.0.0.1:{port}"
            log = open_server_log(logs / f"{c}-L{extra['layers']}.log", spec)
            procs[c] = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            time.sleep(3)
        import requests

        while len(booted) < len(procs) and time.monotonic() < min(deadline, t0 + args.boot_timeout):
            for c, proc in procs.items():
                if c in booted:
                    continue
                if proc.poll() is not None:
                    booted[c] = None
                    tail = (logs / f"{c}-L{extra['layers']}.log").read_text(errors="replace")[-1500:]
                    row = {"label": c, "event": "boot_failed", "exit": proc.returncode, "tail": tail, **extra}
                    sink(row)
                    print(json.dumps(row), flush=True)
                    continue
                try:
                    up = requests.get(urls[c] + "/health", timeout=3).status_code == 200
                except requests.RequestException:
                    up = False
                if up:
                    booted[c] = round(time.monotonic() - t0, 1)
                    row = {"label": c, "event": "booted", "boot_s": booted[c], "argv": plan[c]["argv"],
                           "env": plan[c]["env"], **extra}
                    sink(row)
                    print(json.dumps(row), flush=True)
            time.sleep(2)
        live = [c for c in configs if booted.get(c)]
        for c in configs:
            if c not in booted:
                sink({"label": c, "event": "boot_timeout", **extra})
        # patch 1's servers: their PLE counters settle after each round (stock has none to wait for)
        settle = {c: (args.ple_settle if c != "stock" else 0.0) for c in live}
        if args.warmup_tokens:
            # one untimed round per config and level first: run5's first repeat was the slowest for
            # every config (the first batch of each size pays one-time costs), hoisted's most
            for c in live:
                for conc in levels:
                    if time.monotonic() < deadline:
                        client.warm(urls[c], c, conc, args.warmup_tokens, sink, extra, settle[c])
        rngs = {c: random.Random(12) for c in live}  # each config sees the same prompts in the same order
        for rep in range(args.repeats):
            # concurrency-major: the configs at one level run back to back, so each pair paired()
            # compares shares a window of the machine's noise; the order rotates every repeat
            for j, conc in enumerate(levels):
                turn = (rep + j) % len(live) if live else 0
                for c in live[turn:] + live[:turn]:
                    if time.monotonic() > deadline:
                        sink({"event": "deadline", "repeat": rep, "at_s": round(time.monotonic() - t0, 1), **extra})
                        return 0 if live else 1
                    client.measure_one(urls[c], c, conc, args.tokens, rep, rngs[c], sink, extra, settle[c])
        return 0 if live == configs else 1
    finally:
        servers.stop_all(procs)


def run_cmd(args) -> int:
    client.measure(args.url.rstrip("/"), args.label, client.parse_levels(args.levels), args.tokens, args.repeats, client.jsonl_sink(args.out))
    return 0
