#!/usr/bin/env python3
"""The vision encoder's share of vLLM's profile peak, asked of vLLM 0.33.0 on CPU
(tests/vllm/release/encoder_peak.py, run inside the vllm-tier environment).

  python -m lab.encoder_peak run --out DIR      raw.jsonl: one row per (snapshot, settings)
  python -m lab.encoder_peak table RAW.jsonl    the markdown table

Rows: the gpu-e2e fixture as it is (its small image bounds: 64 tokens an image) at the
BATCHED_TOKENS of the GPU boots whose logs name the item counts; the same bounds with the real
vision tower's width (what recipe48's 48-layer dummy checkpoint profiled); and the image bounds
Qwen3-VL's processors publish (16,777,216 pixels: 16,384 tokens an image), whose budget alone is
asked (one 65,536-patch sequence through CPU attention takes too long to run here).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "vllm" / "release" / "encoder_peak.py"
RELEASE = "0.33.0"
REAL_VISION = "1152,4304,16"  # the published vision tower: hidden, intermediate, heads (27 blocks)
QWEN3_VL_IMAGE_BOUNDS = {"longest_edge": 16777216, "shortest_edge": 65536}
SMALL = [(b, ["--run", "--depth", "2"]) for b in (2048, 4096, 8192)]
SMALL_REAL_WIDTH = [(b, ["--run", "--depth", "1", "--vision", REAL_VISION, "--max-model-len", "262144"])
                    for b in (4096, 8192)]
PUBLISHED_BOUNDS = [(b, ["--max-model-len", "262144"]) for b in (2048, 8192, 16384, 32768)]


def worker(snapshot: Path, batched: int, args: list[str]) -> dict:
    from tools import check_vllm_release

    rt = check_vllm_release.ensure(RELEASE)
    env = dict(rt["env"], CUDA_VISIBLE_DEVICES="", VLLM_LOGGING_LEVEL="ERROR", HF_HUB_OFFLINE="1")
    cmd = [rt["python"], str(WORKER), "--model", str(snapshot), "--batched-tokens", str(batched), "--seqs", "8",
           *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"encoder_peak {batched} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def published_bounds_copy(snapshot: Path, into: Path) -> Path:
    """The fixture's small files with the image processor's bounds replaced by Qwen3-VL's."""
    into.mkdir(parents=True, exist_ok=True)
    for f in snapshot.iterdir():
        if f.suffix in (".json", ".jinja") and "index" not in f.name and not f.name.endswith(".complete.json"):
            shutil.copyfile(f, into / f.name)  # follows the hub cache's links
    pp = json.loads((into / "preprocessor_config.json").read_text())
    (into / "preprocessor_config.json").write_text(json.dumps({**pp, "size": QWEN3_VL_IMAGE_BOUNDS}))
    return into


def run(a) -> int:
    from tests.fakes import tiny_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        snap = tiny_model.write(Path(tmp) / "hf", "nvidia")  # fixture a, as kv_plan_oos booted it
        real = published_bounds_copy(Path(snap), Path(tmp) / "published-bounds")
        jobs = ([("fixture", snap, b, x) for b, x in SMALL] + [("fixture-real-width", snap, b, x) for b, x in SMALL_REAL_WIDTH]
                + [("published-bounds", real, b, x) for b, x in PUBLISHED_BOUNDS])
        with (out / "raw.jsonl").open("w") as f:
            for name, s, b, x in jobs:
                print(name, b, " ".join(x), file=sys.stderr, flush=True)
                f.write(json.dumps({"row": name, "release": RELEASE, **worker(Path(s), b, x)}) + "\n")
                f.flush()
    return 0


def table(a) -> int:
    print("| row | BATCHED_TOKENS | encoder budget | items x tokens | patches | vision hidden/inter | "
          "peak of tensors (CPU) | per patch |")
    print("|---|---|---|---|---|---|---|---|")
    for line in Path(a.raw).read_text().splitlines():
        r = json.loads(line)
        cells = [r["row"], f"{r['batched_tokens']:,}", f"{r['encoder_budget']:,}",
                 f"{r['items']} x {r['tokens_per_item']:,}", f"{r['items'] * r['tokens_per_item'] * r['patches_per_token']:,}"]
        if "peak_bytes" in r:
            cells += [f"{r['vision']['hidden']}/{r['vision']['intermediate']}", f"{r['peak_bytes'] / 2**20:,.0f} MiB",
                      f"{r['bytes_per_patch'] / 1024:.1f} KiB"]
        else:
            cells += ["", "not run", ""]
        print("| " + " | ".join(cells) + " |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("raw")
    a = ap.parse_args(argv)
    return {"run": run, "table": table}[a.cmd](a)


if __name__ == "__main__":
    raise SystemExit(main())
