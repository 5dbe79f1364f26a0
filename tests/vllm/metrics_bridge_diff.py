#!/usr/bin/env python3
"""Measure what flash_vllm's metrics bridge does to a real vLLM release's single-process /metrics
(no GPU, no model: the release's own classes on CPU, in fresh processes each time).

    PYTHONPATH=$FLASH_TEST_CACHE/vllm/shim:src:$FLASH_TEST_CACHE/vllm/site-0.31.0 \\
      $FLASH_TEST_CACHE/vllm/venv-torch-2.13.0/bin/python tests/vllm/metrics_bridge_diff.py [--json OUT]

The API process does what `vllm serve` does: vLLM's own `load_general_plugins()` finds our entry
point and runs `flash_vllm.register()` (patches + the bridge hook), then `PrometheusStatLogger`
is built as AsyncLLM builds it (it calls `unregister_vllm_metrics()`), an "EngineCore" child is
started with multiprocessing (spawn) and creates the PLE engine's `PLEStats` and records lookups,
and `/metrics` is produced through vLLM's `get_prometheus_registry()`. Three runs:

  plain      FLASH_METRICS_BRIDGE=0: stock single-process behaviour (PLE counters invisible)
  bridge     the default: the bridge carries the engine's counters
  multiproc  PROMETHEUS_MULTIPROC_DIR set: the bridge stays out, prometheus_client aggregates

and reports families lost/gained between plain and bridge, label-set changes, and the PLE values.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

OPS = 7

CHILD = r"""
import json, multiprocessing as mp, os, sys, tempfile, time
from types import SimpleNamespace as NS

def engine(ops):
    from flash_vllm.ple.stats import PLEStats
    from flash_vllm import metrics_bridge; metrics_bridge.wire()  # what register() does
    s = PLEStats(stats_sec=0, prometheus=True)
    for _ in range(ops):
        s.record(ops=1, op_s=0.004, gpu_wait_s=0.001, dedup_s=0.0002, gather_s=0.002, stage_s=0.0005,
                 rows=16, bytes=2560)
    time.sleep(0.3)

if __name__ == "__main__":
    # our entry point, as the installed wheel declares it; vLLM's loader finds and runs it
    d = tempfile.mkdtemp()
    dist = os.path.join(d, "flash_recipe-0.1.0.dist-info"); os.mkdir(dist)
    open(os.path.join(dist, "METADATA"), "w").write("Metadata-Version: 2.1\nName: flash-recipe\nVersion: 0.1.0\n")
    open(os.path.join(dist, "entry_points.txt"), "w").write("[vllm.general_plugins]\nflash = flash_vllm:register\n")
    sys.path.insert(0, d)
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.config import CacheConfig, ObservabilityConfig
    cc = CacheConfig(); cc.num_gpu_blocks = 1000
    cfg = NS(observability_config=ObservabilityConfig(), speculative_config=None, kv_transfer_config=None, watermark_config=None,
             ec_transfer_config=None, cache_config=cc, lora_config=None,
             model_config=NS(served_model_name="qwen3.8-flash-next", max_model_len=262144, is_diffusion=False,
                             hf_config=NS(), architecture="Qwen3_8FlashNextForCausalLM"),
             parallel_config=NS(data_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=1),
             scheduler_config=NS(max_num_seqs=8, max_num_batched_tokens=8192))
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    logger = PrometheusStatLogger(cfg, [0])
    def touch(obj, depth=0):  # the first stats update sets every gauge once
        if hasattr(obj, "set") and hasattr(obj, "_value"):
            obj.set(0)
        elif isinstance(obj, dict) and depth < 3:
            for v in obj.values(): touch(v, depth + 1)
        elif isinstance(obj, (list, tuple)) and depth < 3:
            for v in obj: touch(v, depth + 1)
    for value in vars(logger).values():
        touch(value)
    p = mp.get_context("spawn").Process(target=engine, args=(int(sys.argv[1]),))
    p.start(); p.join(300)
    from prometheus_client import generate_latest
    from vllm.v1.metrics.prometheus import get_prometheus_registry
    import vllm
    print(json.dumps({"vllm": vllm.__version__, "engine_exit": p.exitcode,
                      "text": generate_latest(get_prometheus_registry()).decode()}))
"""


def parse(text: str) -> tuple[dict[str, list[list[str]]], dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    fams: dict[str, set] = {}
    values: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        fams.setdefault(fam.name, set()).update(tuple(sorted(k for k in s.labels if k != "le")) for s in fam.samples)
        if fam.name.startswith("vllm:ple_mmap"):
            for s in fam.samples:
                values[s.name] = values.get(s.name, 0.0) + s.value
    return {k: sorted(list(v) for v in vs) for k, vs in fams.items()}, values


def measure(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROMETHEUS_MULTIPROC", "FLASH_METRICS"))}
    env["VLLM_PLE_MMAP"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        env["FLASH_METRICS_DIR"] = os.path.join(tmp, "bridge")
        env["FLASH_METRICS_INTERVAL_MS"] = "50"
        if mode == "plain":
            env["FLASH_METRICS_BRIDGE"] = "0"
        if mode == "multiproc":
            env["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(tmp, "prom")
            os.mkdir(env["PROMETHEUS_MULTIPROC_DIR"])
        script = os.path.join(tmp, "api_server.py")  # a file, so spawn can re-import __main__
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(CHILD)
        p = subprocess.run([sys.executable, script, str(OPS)], env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"{mode}: api process failed:\n{p.stderr[-3000:]}")
        doc = json.loads(p.stdout.strip().splitlines()[-1])
        records = sorted(os.listdir(env["FLASH_METRICS_DIR"])) if os.path.isdir(env["FLASH_METRICS_DIR"]) else []
    fams, values = parse(doc["text"])
    return {"vllm": doc["vllm"], "engine_exit": doc["engine_exit"], "families": fams, "ple_values": values,
            "bridge_records": records, "bridge_log": [l for l in p.stderr.splitlines() if "metrics bridge" in l]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the full result here")
    args = ap.parse_args()
    runs = {m: measure(m) for m in ("plain", "bridge", "multiproc")}
    plain, bridge, multi = (runs[m]["families"] for m in ("plain", "bridge", "multiproc"))
    result = {
        "vllm": runs["bridge"]["vllm"], "ops_recorded": OPS,
        "families": {m: len(r["families"]) for m, r in runs.items()},
        "lost_with_bridge": sorted(set(plain) - set(bridge)),
        "gained_with_bridge": sorted(set(bridge) - set(plain)),
        "label_sets_changed": sorted(f for f in set(plain) & set(bridge) if plain[f] != bridge[f]),
        "ple_ops": {m: r["ple_values"].get("vllm:ple_mmap_lookup_ops_total") for m, r in runs.items()},
        "lost_in_multiproc_vs_bridge": sorted(set(bridge) - set(multi)),
        "bridge_records": {m: len(r["bridge_records"]) for m, r in runs.items()},
        "engine_exit": {m: r["engine_exit"] for m, r in runs.items()},
        "bridge_log": runs["bridge"]["bridge_log"],
    }
    if args.json:
        with open(args.json + ".tmp", "w", encoding="utf-8") as fh:
            json.dump({**result, "runs": {m: {"families": r["families"], "ple_values": r["ple_values"]}
                                          for m, r in runs.items()}}, fh, indent=1)
        os.replace(args.json + ".tmp", args.json)
    print(f"vLLM {result['vllm']}: single-process /metrics {result['families']['plain']} families without the "
          f"bridge, {result['families']['bridge']} with it, {result['families']['multiproc']} in multiprocess mode")
    print(f"  lost with the bridge ({len(result['lost_with_bridge'])}): " + ", ".join(result["lost_with_bridge"]))
    print(f"  gained with the bridge ({len(result['gained_with_bridge'])}): " + ", ".join(result["gained_with_bridge"]))
    print(f"  label sets changed ({len(result['label_sets_changed'])})")
    print(f"  vllm:ple_mmap_lookup_ops_total ({OPS} recorded): " + json.dumps(result["ple_ops"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
