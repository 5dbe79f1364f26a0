"""`flash plan` against the KV pools real `vllm serve` boots reported at the model's own shape.

The planner's constants were fitted on tiny fixtures (gpu-e2e) and on the GB10's field pools. The
recipe48/latency48 benches booted the recipe at 32 and 48 of the real layers (every per-layer
shape, NVFP4 experts, dummy weights) on an H100 and an H200, and each server's log says its pool
("GPU KV cache size"), vLLM's KV budget ("Available KV cache memory") and what it took before it:
the model load ("Model loading took": weights and buffers made at model init), non-torch memory
and the peak activation ("Actual usage is ..."). This asks the planner the same question for each
recipe server, from the configs `lab.bench_recipe prepare` writes, lays its budget out the way
vLLM counts (the QSA top-k buffers in the load; patch 10's draft head outside the budget, as vLLM
books it after its profile's peak) and prints where the two differ, so a change to the planner can be
checked against every real-shape boot on record.

    python3 -m lab.plan_vs_boots DIR32 DIR48 [--json OUT]                 the boots of record (BOOTS)
    python3 -m lab.plan_vs_boots DIR32 DIR48 --raw RUN/raw48.jsonl [...]  a new run's boots

DIR32/DIR48: `python3 -m lab.bench_recipe prepare DIR --layers 32|48 --ple-rows 32000000
--configs-only` (the rows the device sessions used, so a table on the GPU has the boots' size).
`--raw` reads the `booted` rows of recipe48/latency48 raw files that name their words and log
(since 2026-12-07), the logs beside them in logs/. Stock servers are left out: they run without
flash's plugin, which the planner does not model.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from lab.bench_recipe import CONFIGS, OFFLINE_ARGS

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

POOL = re.compile(r"GPU KV cache size:\s*([\d,]+)\s*tokens")
AVAILABLE = re.compile(r"Available KV cache memory:\s*([\d.]+)\s*GiB")
LOADED = re.compile(r"Model loading took\s*([\d.]+)\s*GiB")
# vLLM 0.33's own split of what it took before the KV cache (gpu_worker.py, at the end of the profile)
USAGE = re.compile(r"Actual usage is ([\d.]+) GiB for consumed memory \(weights \+ non-torch\), ([\d.]+) GiB for "
                   r"peak activation, and ([\d.]+) GiB for CUDAGraph memory")

# (boot log, layers, hardware preset, bench config, the --set its run gave every server): each a
# recipe server, planned with the profile and words of bench_recipe's CONFIGS entry it booted
BOOTS = [
    ("recipe48-h200/run1/logs/default-c0.log", 48, "h200", "default", []),
    ("recipe48-h200/run2/logs/default-deepgemm-c0.log", 48, "h200", "default-deepgemm", []),
    ("recipe48-h200/run5-h200-48layers/logs/default-c0.log", 48, "h200", "default", ["GPU_MEM=0.95"]),
    ("recipe48-h200/run5-h200-48layers/logs/default-nvfp4-c0.log", 48, "h200", "default-nvfp4", ["GPU_MEM=0.95"]),
    ("recipe48-h200/run4-h100-32layers/logs/default-c0.log", 32, "h100", "default", ["GPU_MEM=0.95"]),
    ("recipe48-h200/run3-h100-32layers/logs/default-nvfp4-c0.log", 32, "h100", "default-nvfp4", ["GPU_MEM=0.95"]),
    ("recipe48-h200/run4-h100-32layers/logs/default-ple-gpu-c0.log", 32, "h100", "default-ple-gpu", ["GPU_MEM=0.95"]),
    # latency48's `shared` ran before GRAPH_TOKENS=832 shipped: `shared-nographs` renders its argv
    ("latency48-h100/run2-32layers/logs/latency-shared.log", 32, "h100", "shared-nographs", ["GPU_MEM=0.95"]),
    ("latency48-h100/run2-32layers/logs/latency-shared-graphs.log", 32, "h100", "shared-graphs", ["GPU_MEM=0.95"]),
]


def logged(path: Path) -> dict:
    text = path.read_text(errors="replace")
    pool, avail, loaded = POOL.search(text), AVAILABLE.search(text), LOADED.search(text)
    if not (pool and avail and loaded):
        raise SystemExit(f"{path}: no KV pool / available memory / model loading line in this boot log")
    got = {"tokens": int(pool.group(1).replace(",", "")), "kv_gib": float(avail.group(1)),
           "loaded_gib": float(loaded.group(1))}
    usage = USAGE.search(text)  # absent where the boot skipped the profile's last line (DeepGEMM's run2)
    if usage:
        consumed, act, graphs = (float(x) for x in usage.groups())
        got |= {"non_torch_gib": round(consumed - got["loaded_gib"], 3), "activation_gib": act, "graphs_gib": graphs}
    return got


def planned(words: list[str], hardware: str, model_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "flash_cli", "plan", *words, "--hardware", hardware,
                          "--config", str(model_dir), "--json"], capture_output=True, text=True)
    if not out.stdout.strip():  # a plan that does not fit still prints its JSON (exit 1)
        raise SystemExit(f"flash plan {words}: {out.stderr.strip()[-400:]}")
    j = json.loads(out.stdout)
    b = j["budget"]
    # laid out as vLLM counts it: the model load holds the weights and the QSA top-k buffers (allocated at
    # model init). Patch 10's draft head is outside the plan's budget (vLLM books it after its profile's
    # peak: in "consumed", out of the peak activation), and the fitted runtime term absorbed it
    return {"tokens": j["kv_cache_tokens"], "range": j["kv_cache_tokens_range"], "kv_gib": b["kv_cache_gib"],
            "loaded_gib": round(b["weights_gib"] + b["topk_buffers_gib"], 3),
            "non_torch_gib": round(b["runtime_overhead_gib"], 3),
            "activation_gib": round(b["activations_gib"] + b["graphs_above_vllm_gib"], 3)}


def with_offline(words: list[str]) -> list[str]:
    """A server's profile and words with the argv bench_recipe.render appends (OFFLINE_ARGS:
    `--gdn-prefill-backend triton`, which exports no Mamba prefill checkpoints, so one state block
    fewer a request) as EXTRA, after any EXTRA the words give."""
    extra = [w.split("=", 1)[1] for w in words if w.startswith("EXTRA=")]
    rest = [w for w in words if not w.startswith("EXTRA=")]
    return [*rest, "EXTRA=" + " ".join([*extra, shlex.join(OFFLINE_ARGS)])]


def bench_words(config: str, sets: list[str]) -> list[str]:
    """What `config` of bench_recipe.CONFIGS booted with, its run's --set and the offline argv."""
    return with_offline([CONFIGS[config]["profile"], *CONFIGS[config]["words"], *sets])


def preset(gpu: str) -> str:
    """The hardware preset of the card a raw row names ("NVIDIA H100 80GB HBM3" -> h100)."""
    for name in ("h200", "h100"):
        if name in gpu.lower():
            return name
    raise SystemExit(f"a boot on {gpu!r}: no hardware preset for it (h100, h200)")


def raw_boots(raw: Path) -> list[tuple[Path, int, str, list[str]]]:
    """(log, layers, preset, words) of every recipe server a raw file booted, from its `booted` rows."""
    out, old = [], []
    for line in raw.read_text().splitlines():
        r = json.loads(line)
        if r.get("event") != "booted" or CONFIGS.get(r.get("label"), {}).get("kind") != "recipe":
            continue
        if "words" not in r or "log" not in r:
            old.append(r["label"])
            continue
        out.append((raw.parent / "logs" / r["log"], r["layers"], preset(r["gpu"]), with_offline(r["words"])))
    if old:
        raise SystemExit(f"{raw}: booted rows without their words ({', '.join(old)}): recorded before rows named "
                         "them; BOOTS lists those of record with their words")
    return out


def compare(dirs: dict[int, Path], boots: list[tuple[Path, int, str, list[str]]] | None = None) -> list[dict]:
    """Each boot (default: BOOTS, the boots of record) planned and set beside its log."""
    if boots is None:
        boots = [(BENCH / log, layers, hw, bench_words(config, sets)) for log, layers, hw, config, sets in BOOTS]
    rows = []
    for path, layers, hw, words in boots:
        mode = next((w.split("=", 1)[1] for w in words if w.startswith("MODE=")), "hybrid")
        mdir = dirs[layers] / ("model-hybrid" if mode == "hybrid" else "model")
        got, plan = logged(path), planned(words, hw, mdir)
        log = str(path.relative_to(BENCH)) if path.is_relative_to(BENCH) else str(path)
        short = {k: round(got[k] - plan[k], 3) for k in ("loaded_gib", "non_torch_gib", "activation_gib") if k in got}
        rows.append({"boot": log, "layers": layers, "hardware": hw, "words": words, "logged": got, "planned": plan,
                     "tokens_err_pct": round(100 * (plan["tokens"] - got["tokens"]) / got["tokens"], 2),
                     "in_range": plan["range"][0] <= got["tokens"] <= plan["range"][1],
                     "plan_short_gib": short, "kv_over_gib": round(plan["kv_gib"] - got["kv_gib"], 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m lab.plan_vs_boots", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir32", type=Path, help="bench_recipe prepare --layers 32 directory")
    ap.add_argument("dir48", type=Path, help="bench_recipe prepare --layers 48 directory")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--raw", type=Path, nargs="+", help="a run's raw files: its boots instead of the boots of record")
    args = ap.parse_args(argv)
    boots = None if not args.raw else [b for raw in args.raw for b in raw_boots(raw)]
    rows = compare({32: args.dir32, 48: args.dir48}, boots)
    print(f"{'boot':62} {'logged':>10} {'planned':>10} {'err':>7}  in band  KV over | the plan short (GiB): "
          "load  non-torch  activation")
    for r in rows:
        sh = r["plan_short_gib"]
        parts = "  ".join(f"{sh[k]:+.3f}" if k in sh else "   n/a" for k in ("loaded_gib", "non_torch_gib", "activation_gib"))
        print(f"{r['boot'][:62]:62} {r['logged']['tokens']:>10,} {r['planned']['tokens']:>10,} "
              f"{r['tokens_err_pct']:>+6.2f}%  {'yes' if r['in_range'] else 'no':7}  {r['kv_over_gib']:+.3f} | {parts}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
