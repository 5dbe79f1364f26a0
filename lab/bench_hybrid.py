#!/usr/bin/env python3
"""Benchmark: full-scale fp8 hybrid preparation vs its I/O floor, side by side on the same files.

    python3 -m lab.bench_hybrid [--dir DIR] [--reps 2] [--layout radixark] [--out benchmarks/hybrid-prep/hybrid-prep.json]

Builds a full-size replica of the checkpoint (real names, shapes, dtypes, file sizes) under
DIR: sparse files, except that the 312 side-layer tensors get real random BF16 data (zeros
would convert ~30% faster than real weights). Then alternates, `--reps` times each, every
measurement starting with the source shards dropped from the page cache (all read cold):
- floor: read every side-layer tensor's bytes (the only data the conversion needs) and write
  files of exactly the new shards' sizes (fsync'd, like the prep), nothing else — the issue's
  yardstick, with plain buffered writes;
- floor, write-behind: the same bytes written with the prep's own write-behind
  (stwriter.WriteBehind), so a faster write policy cannot make the ratio look better than it is;
- copy floor: the same plus reading the untouched tensors the new shards must contain
  (copy_file_range, as the prep does): everything the prep does except the fp8 math;
- prep: `hybrid.build()` (the code `flash prepare hybrid` runs) in a child process, with its
  peak RSS and CPU seconds.
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

from flash_cli import hfcache
from flash_cli.checkpoint import fp8, hybrid, stwriter
from tests.fakes import ckpt

ROOT = Path(__file__).resolve().parents[1]


def drop_source_cache(plan: hybrid.Plan) -> None:
    """Start every measurement with the source shards out of the page cache (same footing)."""
    for fp in plan.files:
        fd = os.open(plan.source / fp.name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def floor(plan: hybrid.Plan, out_dir: Path, write_behind: bool = False) -> float:
    """Read the side-layer bytes, write the new shards' byte count; fsync. The I/O lower bound."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for fp in plan.files:
        src = os.open(plan.source / fp.name, os.O_RDONLY)
        dst = os.open(out_dir / fp.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        wb = stwriter.WriteBehind(dst) if write_behind else None
        left, pos = fp.new_size, 0

        def put(data) -> None:
            nonlocal pos
            view = memoryview(data)
            while view:
                n = os.write(dst, view)
                if wb is not None:
                    wb.wrote(pos, n)
                pos += n
                view = view[n:]

        try:
            for _, s in fp.entries:
                if s[0] == "weight":
                    data = os.pread(src, s[1].nbytes, s[1].begin)
                    n = min(len(data) // 2, left)  # the fp8 weight is half the bf16 bytes
                    put(memoryview(data)[:n])
                    left -= n
            block = b"\0" * (64 << 20)
            while left > 0:  # the rest of the new shard (copied tensors, header, scales)
                n = min(left, len(block))
                put(memoryview(block)[:n])
                left -= n
            os.fsync(dst)
        finally:
            os.close(src)
            os.close(dst)
    dt = time.perf_counter() - t0
    shutil.rmtree(out_dir)
    return dt


def copy_floor(plan: hybrid.Plan, out_dir: Path) -> float:
    """Everything but the math: side-layer bytes read, untouched tensors copied, sizes written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for fp in plan.files:
        src = os.open(plan.source / fp.name, os.O_RDONLY)
        dst = os.open(out_dir / fp.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        written = 0
        try:
            for e, s in fp.entries:
                if s[0] == "copy":
                    off, end = s[1], s[1] + e.nbytes
                    while off < end:
                        n = os.copy_file_range(src, dst, min(64 << 20, end - off), off)
                        off += n
                        written += n
                elif s[0] == "weight":
                    data = os.pread(src, s[1].nbytes, s[1].begin)
                    os.write(dst, memoryview(data)[: len(data) // 2])
                    written += len(data) // 2
            os.write(dst, b"\0" * (fp.new_size - written))
            os.fsync(dst)
        finally:
            os.close(src)
            os.close(dst)
    dt = time.perf_counter() - t0
    shutil.rmtree(out_dir)
    return dt


def fill_side_layers(plan: hybrid.Plan) -> None:
    """Real random BF16 data where the conversion reads (written into the replica's blobs)."""
    import ml_dtypes
    import numpy as np

    pattern = (np.random.default_rng(0).standard_normal(32 << 20).astype(np.float32) * 0.02)
    pattern = pattern.astype(ml_dtypes.bfloat16).tobytes()  # 64 MB, reused with a rotating start
    for fp in plan.files:
        fd = os.open(plan.source / fp.name, os.O_WRONLY)
        try:
            for _, s in fp.entries:
                if s[0] != "weight":
                    continue
                t, pos = s[1], 0
                while pos < t.nbytes:
                    start = (pos // 2 * 7919 * 2) % (len(pattern) // 2)
                    chunk = (pattern[start:] + pattern[:start])[: min(len(pattern), t.nbytes - pos)]
                    os.pwrite(fd, chunk, t.begin + pos)
                    pos += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)


PREP_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()  # includes importing numba and loading the cached kernel, as a real run pays
import numpy as np
from pathlib import Path
from flash_cli.checkpoint import fp8, hybrid
fp8.quantize_strip(np.zeros(128 * 128, np.uint16), 128, 128)
kernel_s = time.perf_counter() - t0
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
p = hybrid.plan(src, dst)
m = hybrid.build(p)
dt = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": dt, "kernel_load_s": kernel_s, "maxrss_kb": ru.ru_maxrss,
                  "cpu_s": ru.ru_utime + ru.ru_stime, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
                  "tensors": m["tensors"], "worst": m["worst_block_rel_err"]}))
"""


def prep(snapshot: Path) -> dict:
    dst = hfcache.variant_dir(snapshot, "hybrid")
    if dst.exists():
        shutil.rmtree(dst)
    r = subprocess.run([sys.executable, "-c", PREP_CHILD, str(snapshot), str(dst)], capture_output=True, text=True,
                       check=True)
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
    t0 = time.perf_counter()
    fill_side_layers(plan)
    print(f"side layers filled with random BF16 in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"replica in {gen:.1f} s; {len(plan.targets)} tensors in {len(plan.files)} files; "
          f"reads {plan.read_bytes / 1e9:.2f} GB of side layers, writes {need / 1e9:.2f} GB", flush=True)
    floors, floors_wb, copies, preps, loads = [], [], [], [], []
    cpus: dict[str, list] = {"floor": [], "floor_write_behind": [], "copy_floor": []}
    for i in range(a.reps):
        loads.append(os.getloadavg()[0])
        drop_source_cache(plan)
        c0 = cpu_s()
        f = floor(plan, a.dir / "floor-out")
        cpus["floor"].append(round(cpu_s() - c0, 1))
        floors.append(f)
        print(f"  rep {i + 1}: floor {f:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
        drop_source_cache(plan)
        c0 = cpu_s()
        f = floor(plan, a.dir / "floor-out", write_behind=True)
        cpus["floor_write_behind"].append(round(cpu_s() - c0, 1))
        floors_wb.append(f)
        print(f"  rep {i + 1}: floor, write-behind {f:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
        drop_source_cache(plan)
        c0 = cpu_s()
        c = copy_floor(plan, a.dir / "copy-out")
        cpus["copy_floor"].append(round(cpu_s() - c0, 1))
        copies.append(c)
        print(f"  rep {i + 1}: copy floor {c:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
        drop_source_cache(plan)
        p = prep(snap)
        preps.append(p)
        print(f"  rep {i + 1}: prep  {p['seconds']:.1f} s (CPU {p['cpu_s']:.1f} s, kernel load {p['kernel_load_s']:.2f} s, "
              f"peak RSS {p['maxrss_kb'] / 1024:.0f} MiB, load {os.getloadavg()[0]:.1f})", flush=True)
    second = [second_run(cache, {"radixark": ckpt.RADIXARK, "nvidia": ckpt.NVIDIA}[a.layout]) for _ in range(3)]
    med_prep = statistics.median(p["seconds"] for p in preps)
    ratio = med_prep / statistics.median(floors)
    best_floor = min(statistics.median(floors), statistics.median(floors_wb))
    kern = fp8.kernel()
    result = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "fp8_kernel": f"numba {kern.numba.__version__} (fp8_kernel.py, fused)" if kern else "numpy (no numba)",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) or "lab/bench_hybrid.py",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "layout": a.layout, "tensors": len(plan.targets), "files": [f.name for f in plan.files],
        "read_bytes": plan.read_bytes, "write_bytes": need,
        "floor_s": floors, "floor_write_behind_s": floors_wb, "copy_floor_s": copies,
        "prep_s": [p["seconds"] for p in preps],
        "floors_cpu_s": cpus, "prep_cpu_s": [round(p["cpu_s"], 1) for p in preps], "prep_user_s": [round(p["user_s"], 1) for p in preps],
        "prep_sys_s": [round(p["sys_s"], 1) for p in preps],
        "prep_kernel_load_s": [round(p["kernel_load_s"], 2) for p in preps], "load_avg_1min_at_rep_start": loads,
        "load_avg_1min_at_end": os.getloadavg()[0],
        "ratio_to_best_floor_median": round(med_prep / best_floor, 3),
        "ratio_to_copy_floor_median": round(statistics.median(p["seconds"] for p in preps) / statistics.median(copies), 3),
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
