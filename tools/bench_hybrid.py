#!/usr/bin/env python3
"""Benchmark: full-scale fp8 hybrid preparation vs its I/O floor, side by side on the same files.

    tools/bench_hybrid.py [--dir DIR] [--reps 2] [--layout radixark] [--out docs/benchmarks/hybrid-prep.json]

Builds a full-size sparse replica of the checkpoint (real names, shapes, dtypes, file sizes;
data are holes) under DIR, then alternates, `--reps` times each:
- floor: read every side-layer tensor's bytes (the only data the conversion needs) and write
  files of exactly the new shards' sizes (fsync'd, like the prep), nothing else;
- prep: `hybrid.build()` (the code `flash prepare hybrid` runs) in a child process, with its peak RSS.
Then the second run: `scripts/prepare-hybrid.sh` on the prepared snapshot, timed end to end.
Outputs are deleted after each measurement (they are real bytes: ~13 GB for RadixArk).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from fakes import ckpt  # noqa: E402
from flash_cli import hfcache  # noqa: E402
from flash_cli.checkpoint import hybrid  # noqa: E402


def floor(plan: hybrid.Plan, out_dir: Path) -> float:
    """Read the side-layer bytes, write the new shards' byte count; fsync. The I/O lower bound."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for fp in plan.files:
        src = os.open(plan.source / fp.name, os.O_RDONLY)
        dst = os.open(out_dir / fp.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = fp.new_size
        try:
            for _, s in fp.entries:
                if s[0] == "weight":
                    data = os.pread(src, s[1].nbytes, s[1].begin)
                    n = min(len(data) // 2, left)  # the fp8 weight is half the bf16 bytes
                    os.write(dst, memoryview(data)[:n])
                    left -= n
            block = b"\0" * (64 << 20)
            while left > 0:  # the rest of the new shard (copied tensors, header, scales)
                n = min(left, len(block))
                os.write(dst, block[:n])
                left -= n
            os.fsync(dst)
        finally:
            os.close(src)
            os.close(dst)
    dt = time.perf_counter() - t0
    shutil.rmtree(out_dir)
    return dt


PREP_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from flash_cli.checkpoint import hybrid
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
t0 = time.perf_counter()
p = hybrid.plan(src, dst)
m = hybrid.build(p)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "tensors": m["tensors"], "worst": m["worst_block_rel_err"]}))
"""


def prep(snapshot: Path) -> dict:
    dst = hfcache.variant_dir(snapshot, "hybrid")
    if dst.exists():
        shutil.rmtree(dst)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-c", PREP_CHILD, str(snapshot), str(dst)], capture_output=True, text=True,
                       env=env, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def second_run(cache: Path, model: str) -> float:
    env = dict(os.environ, HF_CACHE=str(cache), MODEL=model)
    env.pop("REVISION", None)
    t0 = time.perf_counter()
    r = subprocess.run([str(ROOT / "scripts" / "prepare-hybrid.sh")], env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0 or "already prepared" not in r.stderr:
        raise SystemExit(f"second run did not find the prepared variant: {r.stderr}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("FLASH_TEST_CACHE", Path.home() / ".cache/flash-tests")) / "bench-hybrid")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layout", choices=("radixark", "nvidia"), default="radixark")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.dir.exists():
        shutil.rmtree(a.dir)
    cache = a.dir / "hf"
    t0 = time.perf_counter()
    snap = ckpt.write_snapshot(cache, a.layout, ckpt.REAL, sparse=True)
    gen = time.perf_counter() - t0
    plan = hybrid.plan(snap, hfcache.variant_dir(snap, "hybrid"))
    need = sum(f.new_size for f in plan.files)
    free = shutil.disk_usage(a.dir).free
    if need * 1.1 > free:
        raise SystemExit(f"needs {need / 1e9:.1f} GB free under {a.dir}, has {free / 1e9:.1f}")
    print(f"replica in {gen:.1f} s; {len(plan.targets)} tensors in {len(plan.files)} files; "
          f"reads {plan.read_bytes / 1e9:.2f} GB of side layers, writes {need / 1e9:.2f} GB", flush=True)
    floors, preps = [], []
    for i in range(a.reps):
        f = floor(plan, a.dir / "floor-out")
        floors.append(f)
        print(f"  rep {i + 1}: floor {f:.1f} s", flush=True)
        p = prep(snap)
        preps.append(p)
        print(f"  rep {i + 1}: prep  {p['seconds']:.1f} s (peak RSS {p['maxrss_kb'] / 1024:.0f} MiB)", flush=True)
    second = [second_run(cache, {"radixark": ckpt.RADIXARK, "nvidia": ckpt.NVIDIA}[a.layout]) for _ in range(3)]
    ratio = statistics.median(p["seconds"] for p in preps) / statistics.median(floors)
    result = {
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) or "tools/bench_hybrid.py",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "layout": a.layout, "tensors": len(plan.targets), "files": [f.name for f in plan.files],
        "read_bytes": plan.read_bytes, "write_bytes": need,
        "floor_s": floors, "prep_s": [p["seconds"] for p in preps],
        "prep_peak_rss_mib": [round(p["maxrss_kb"] / 1024) for p in preps],
        "worst_block_rel_err": preps[-1]["worst"], "ratio_median": round(ratio, 3),
        "second_run_s": second,
    }
    print(json.dumps(result, indent=2))
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(a.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
