"""The /metrics contract the gates and the dashboard rely on, and the multiprocess-mode cost
(docs/OBSERVABILITY.md): measured on prometheus_client itself, mirrored by the stand-in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import requests

from flash_cli.gates import metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standin"))
from harness import StandIn  # noqa: E402

MP_PROBE = r"""
import json, os, tempfile
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families as parse
Counter("vllm:prompt_tokens", "d", ["model_name"]).labels("m").inc(5)
Histogram("vllm:time_to_first_token_seconds", "d", ["model_name"]).labels("m").observe(0.2)
Gauge("vllm:num_requests_running", "d", ["model_name"], multiprocess_mode="livesum").labels("m").set(1)
mp = CollectorRegistry(); multiprocess.MultiProcessCollector(mp)
single = {f.name for f in parse(generate_latest(prometheus_client.REGISTRY).decode()) if f.name.startswith("vllm")}
multi = {f.name for f in parse(generate_latest(mp).decode())}
print(json.dumps({"single": sorted(single), "multi": sorted(multi)}))
"""


def test_prometheus_client_multiprocess_mode_drops_only_created_families():
    out = json.loads(subprocess.run([sys.executable, "-c", MP_PROBE], capture_output=True, text=True, check=True,
                                    timeout=30).stdout)
    lost = set(out["single"]) - set(out["multi"])
    assert lost == {"vllm:prompt_tokens_created", "vllm:time_to_first_token_seconds_created"}
    assert set(out["multi"]) <= set(out["single"])


def test_standin_mirrors_it_and_exports_the_contract(tmp_path):
    with StandIn(env={"VLLM_PLE_MMAP": "1"}) as s:
        single = metrics.family_names(requests.get(s.url + "/metrics", timeout=5).text)
    with StandIn(env={"VLLM_PLE_MMAP": "1", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}) as s:
        multi = metrics.family_names(requests.get(s.url + "/metrics", timeout=5).text)
    assert single - multi == {n for n in single if n.endswith("_created") or n.startswith(("process_", "python_"))}
    assert set(metrics.CORE_FAMILIES) <= multi and set(metrics.PLE_FAMILIES) <= multi
    assert "vllm:ple_mmap_engine_start_time_seconds" in single
