#!/usr/bin/env python3
"""docs/PREFIX-CACHE.md's table: which shared-prefix prompts hit, asked of every release's own
scheduler (tests/vllm/release/prefix_sim.py, run inside each vllm-tier environment).

  python -m lab.prefix_hits run SNAPSHOT --out DIR [--releases 0.33.0,…]   raw.jsonl + footprint.jsonl
  python -m lab.prefix_hits table RAW.jsonl     the markdown table (hits of the second / third prompt)
  python -m lab.prefix_hits beside SNAPSHOT --out DIR [--releases …]   beside.jsonl: a 32,768-token
      prompt prefilling beside a decoding stream (and alone), default vs shared, per release
  python -m lab.prefix_hits beside-table BESIDE.jsonl

SNAPSHOT is any qwen4_exp snapshot (its config only; `python tests/fakes/tiny_model.py DIR`
makes one offline). Rows: the default recipe (flash_vllm registered) under PREFIX_RETAIN 0 and
dense on every release; NVIDIA's one-Spark settings on stock 0.33; MTP_BLOCK_DROP=0 on 0.32; and
one 100,000-token prompt's pool footprint on 0.33 under both retentions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "tests" / "vllm" / "release" / "prefix_sim.py"
RELEASES = ("0.33.0", "0.32.0", "0.31.0", "0.30.0", "0.29.0")
RECIPE = (["--flash", "--retention", "0"], ["--flash", "--retention", "none"])
NVIDIA = ["--mtp", "4", "--kv-dtype", "fp8_e4m3", "--batched-tokens", "4096"]  # profiles/nvidia.env
PLAN = {
    "0.33.0": [*RECIPE, NVIDIA + ["--retention", "0"], NVIDIA + ["--retention", "none"]],
    "0.32.0": [*RECIPE, ["--flash", "--retention", "0", "--keep-block"]],
}
FOOTPRINT = ("0.33.0", [["--flash", "--retention", r, "--long", "100000"] for r in ("0", "none")])


def sim(release: str, snapshot: str, args: list[str]) -> dict:
    """One prefix_sim run in that release's vllm-tier environment; its JSON with `args` added."""
    from tools import check_vllm_release

    rt = check_vllm_release.ensure(release)
    env = dict(rt["env"], CUDA_VISIBLE_DEVICES="", VLLM_LOGGING_LEVEL="ERROR", HF_HUB_OFFLINE="1")
    proc = subprocess.run([rt["python"], str(SIM), "--model", snapshot, *args, "--json"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"prefix_sim on {release} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "args": " ".join(args)}


def write(path: Path, snapshot: str, jobs) -> None:
    """One prefix_sim row per (release, args) of `jobs`, written as each comes (a long run keeps what it has)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for release, args in jobs:
            print(release, " ".join(args), file=sys.stderr, flush=True)
            f.write(json.dumps(sim(release, snapshot, args)) + "\n")
            f.flush()


def run(a) -> int:
    out = Path(a.out)
    write(out / "raw.jsonl", a.snapshot, [(r, args) for r in a.releases.split(",") for args in PLAN.get(r, RECIPE)])
    release, runs = FOOTPRINT
    write(out / "footprint.jsonl", a.snapshot, [(release, args) for args in runs])
    return 0


def name(args: str) -> str:
    retain = "dense" if "none" in args else "0"
    if "--flash" not in args:
        return f"NVIDIA's settings, stock vLLM, retention {retain}"
    return f"flash default, PREFIX_RETAIN={retain}" + (", MTP_BLOCK_DROP=0" if "--keep-block" in args else "")


def table(rows: list[dict]) -> str:
    prefixes = sorted({r["prefix"] for d in rows for r in d["rows"]})
    lines = ["| vLLM | settings (block, tokens) | tail | " + " | ".join(f"{p:,}" for p in prefixes) + " |",
             "|---|---|---|" + "---|" * len(prefixes)]
    for d in rows:
        for tail in sorted({r["tail"] for r in d["rows"]}):
            cells = []
            for p in prefixes:
                hits = next(r["hits"] for r in d["rows"] if r["prefix"] == p and r["tail"] == tail)
                cells.append(f"{hits[1]:,} / {hits[2]:,}")
            lines.append(f"| {d['vllm']} | {name(d['args'])} ({d['block_size']:,}) | {tail:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# a 32,768-token prompt beside a decoding stream (docs/PREFIX-CACHE.md, "A long prefill beside a
# decoding stream"): default; shared (800, profiles/shared.env); shared's value until 2026-12-05
# (1,024); each also alone; NVIDIA's settings on stock 0.33
BESIDE_LONG = 32768
BESIDE = (["--flash"], ["--flash", "--long-prefill", "800"], ["--flash", "--long-prefill", "1024"])
BESIDE_PLAN = {"0.33.0": [*BESIDE, NVIDIA]}


def beside(a) -> int:
    write(Path(a.out) / "beside.jsonl", a.snapshot,
          [(r, [*args, "--beside", str(BESIDE_LONG), *alone]) for r in a.releases.split(",")
           for args in BESIDE_PLAN.get(r, BESIDE) for alone in ([], ["--alone"])])
    return 0


def beside_name(args: str) -> str:
    if "--flash" not in args:
        return "NVIDIA's settings, stock vLLM"
    if "--long-prefill 800" in args:
        return "flash shared (800)"
    if "--long-prefill 1024" in args:
        return "flash shared, 1,024 (before 2026-12-05)"
    return "flash default"


def beside_table(rows: list[dict]) -> str:
    lines = ["| vLLM | settings | beside a stream: steps (stream stalls) | chunks | alone: steps | chunks |",
             "|---|---|---|---|---|---|"]

    def chunks(c: list[int]) -> str:
        # a repeated pattern folded (8,000 ×4, 768; (1,024, 576) ×20, 768), the rest listed
        body, last = c[:-1], c[-1]
        for period in (1, 2):
            n = len(body) // period
            if n > 1 and body == body[:period] * n:
                pat = ", ".join(f"{x:,}" for x in body[:period])
                return f"{'(' + pat + ')' if period > 1 else pat} ×{n}, {last:,}"
        return ", ".join(f"{x:,}" for x in c)

    keyed = {(d["vllm"], d["args"].replace(" --alone", "")): d for d in rows if "--alone" not in d["args"]}
    alone = {(d["vllm"], d["args"].replace(" --alone", "")): d for d in rows if "--alone" in d["args"]}
    for key, d in keyed.items():
        a = alone.get(key)
        lines.append(f"| {d['vllm']} | {beside_name(d['args'])} | {d['steps']} ({d['stalls']}) | {chunks(d['chunks'])} | "
                     + (f"{a['steps']} | {chunks(a['chunks'])} |" if a else "– | – |"))
    return "\n".join(lines)


def rows(path: str) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def show(a) -> int:
    """`table` / `beside-table`: the markdown table of a raw file."""
    print(a.render(rows(a.raw)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd, func in (("run", run), ("beside", beside)):
        p = sub.add_parser(cmd)
        p.add_argument("snapshot")
        p.add_argument("--out", required=True)
        p.add_argument("--releases", default=",".join(RELEASES))
        p.set_defaults(func=func)
    for cmd, render in (("table", table), ("beside-table", beside_table)):
        p = sub.add_parser(cmd)
        p.add_argument("raw")
        p.set_defaults(func=show, render=render)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
