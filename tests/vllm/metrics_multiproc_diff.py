#!/usr/bin/env python3
"""Measure what prometheus_client's multiprocess mode does to vLLM's /metrics, with vLLM's own
metric definitions and our PLE counters (no GPU, no model: the real classes on CPU).

Run it with a vLLM release importable (the vllm tier's venvs):

    PYTHONPATH=$FLASH_TEST_CACHE/vllm/site-0.31.0:$FLASH_TEST_CACHE/vllm/shim:src \\
      $FLASH_TEST_CACHE/vllm/venv-torch-2.13.0/bin/python tests/vllm/metrics_multiproc_diff.py [--json OUT]

It builds the exposition twice, each in fresh processes, exactly as vLLM's API server serves it:
  single:  the API process registers vLLM's PrometheusStatLogger (as AsyncLLM does) and serves
           prometheus_client.REGISTRY; the PLE counters are created in a second process (the
           EngineCore, where the lookup runs)
  multi:   the same with PROMETHEUS_MULTIPROC_DIR set, served through vLLM's
           get_prometheus_registry() (a MultiProcessCollector)
and reports the families each one has, the PLE counters' visibility, and label-set changes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys
from types import SimpleNamespace as NS
role = sys.argv[1]
if role == "engine":  # the EngineCore: our PLE counters, incremented by one lookup
    from flash_vllm.ple import stats
    s = stats.PLEStats(stats_sec=3600, prometheus=True)
    s.record(ops=1, op_s=0.01, gpu_wait_s=0.002, dedup_s=0.001, gather_s=0.005, stage_s=0.001, rows=16, bytes=2560)
    print("ok")
    sys.exit(0)
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
# A live server sets its gauges on every stats update; in multiprocess mode a "mostrecent" gauge
# that was never set has no sample at all, so set each once (to 0) like the first update does.
def touch(obj, depth=0):
    if hasattr(obj, "set") and hasattr(obj, "_value"):
        obj.set(0)
    elif isinstance(obj, dict) and depth < 3:
        for v in obj.values():
            touch(v, depth + 1)
    elif isinstance(obj, (list, tuple)) and depth < 3:
        for v in obj:
            touch(v, depth + 1)
for value in vars(logger).values():
    touch(value)
from prometheus_client import generate_latest
from vllm.v1.metrics.prometheus import get_prometheus_registry
import vllm
print(json.dumps({"vllm": vllm.__version__, "text": generate_latest(get_prometheus_registry()).decode()}))
"""


def families(text: str) -> dict[str, list[list[str]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, set()).update(tuple(sorted(k for k in s.labels if k != "le")) for s in fam.samples)
    return {k: sorted(list(v) for v in vs) for k, vs in out.items()}


def measure(multi: bool) -> tuple[str, dict]:
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env["FLASH_METRICS_BRIDGE"] = "0"  # stock behaviour: what multiprocess mode alone does (the bridge: metrics_bridge_diff.py)
    tmp = None
    if multi:
        tmp = tempfile.TemporaryDirectory()
        env["PROMETHEUS_MULTIPROC_DIR"] = tmp.name
    try:
        eng = subprocess.run([sys.executable, "-c", CHILD, "engine"], env=env, capture_output=True, text=True, timeout=300)
        if eng.returncode != 0:
            raise SystemExit(f"engine process failed:\n{eng.stderr[-2000:]}")
        api = subprocess.run([sys.executable, "-c", CHILD, "api"], env=env, capture_output=True, text=True, timeout=300)
        if api.returncode != 0:
            raise SystemExit(f"api process failed:\n{api.stderr[-2000:]}")
        doc = json.loads(api.stdout.strip().splitlines()[-1])
        return doc["vllm"], families(doc["text"])
    finally:
        if tmp:
            tmp.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the full result here")
    args = ap.parse_args()
    version, single = measure(False)
    _, multi = measure(True)
    lost, gained = sorted(set(single) - set(multi)), sorted(set(multi) - set(single))
    relabelled = sorted(f for f in set(single) & set(multi) if single[f] != multi[f])
    ple = lambda fams: sorted(f for f in fams if f.startswith("vllm:ple_mmap"))
    result = {
        "vllm": version, "single_families": len(single), "multi_families": len(multi),
        "vllm_families_single": len([f for f in single if f.startswith("vllm:") and not f.endswith("_created")]),
        "lost_in_multi": lost, "gained_in_multi": gained, "label_sets_changed": relabelled,
        "ple_visible_single": ple(single), "ple_visible_multi": ple(multi),
    }
    if args.json:
        with open(args.json + ".tmp", "w", encoding="utf-8") as fh:
            json.dump({**result, "single": single, "multi": multi}, fh, indent=1)
        os.replace(args.json + ".tmp", args.json)
    print(f"vLLM {version}: single-process /metrics {len(single)} families, multiprocess {len(multi)}")
    print(f"  lost in multiprocess mode ({len(lost)}): " + ", ".join(lost))
    print(f"  gained in multiprocess mode ({len(gained)}): " + ", ".join(gained))
    print(f"  label sets changed ({len(relabelled)}): " + ", ".join(relabelled))
    print(f"  PLE counters visible: single {len(result['ple_visible_single'])}, multi {len(result['ple_visible_multi'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
