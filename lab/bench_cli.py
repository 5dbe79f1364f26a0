#!/usr/bin/env python3
"""Wall-clock latency of the everyday commands, as users run them (`./flash …`), median of N.

Target (issue 2): `flash --help`, `flash serve default --dry-run` and `flash status` ≤ 0.3 s once
the environment exists. Prints one table and, with --json, one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "help": ["--help"],
    "serve-dry-run": ["serve", "default", "--dry-run"],
    "status": ["status"],
    "profiles": ["profiles"],
}


def time_once(argv: list[str], env: dict | None = None) -> tuple[float, int]:
    t0 = time.perf_counter()
    res = subprocess.run([str(ROOT / "flash"), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, **(env or {})})
    return time.perf_counter() - t0, res.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=15, help="runs per command (default 15)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--running", metavar="NAME", help="also time `flash status` for this running flash container")
    args = ap.parse_args()
    commands = dict(COMMANDS)
    envs = {}
    if args.running:
        commands["status-running"] = ["status"]
        envs["status-running"] = {"NAME": args.running}
    time_once(["--version"])  # first use builds the venv and byte-compiles; not what we measure
    out = {"machine": f"{platform.machine()} {os.cpu_count()} cpus", "load_before": os.getloadavg()[0], "python": platform.python_version(), "runs": args.n,
           "results": {}}
    # Interleave commands so machine noise spreads evenly over them.
    samples: dict[str, list[float]] = {k: [] for k in commands}
    codes: dict[str, int] = {}
    for _ in range(args.n):
        for key, argv in commands.items():
            t, rc = time_once(argv, envs.get(key))
            samples[key].append(t)
            codes[key] = rc
    for key, xs in samples.items():
        out["results"][key] = {"median_s": round(statistics.median(xs), 4), "min_s": round(min(xs), 4),
                               "max_s": round(max(xs), 4), "exit_code": codes[key]}
    print(f"{'command':<16}{'median':>9}{'min':>9}{'max':>9}  rc")
    for key, r in out["results"].items():
        print(f"{key:<16}{r['median_s']:>9.3f}{r['min_s']:>9.3f}{r['max_s']:>9.3f}  {r['exit_code']}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
