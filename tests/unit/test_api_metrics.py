"""status/stop read a few series from /metrics with a line reader; prove it equals prometheus_client."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from flash_cli.api import metric_sums

NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prefix_cache_hits_total",
         "vllm:prefix_cache_queries_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count")


def reference(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in NAMES:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_line_reader_matches_prometheus_client_on_tricky_text():
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="a b} c"} 2.0',
        'vllm:num_requests_running{engine="1",model_name="x"} 1.0 1700000000000',
        "vllm:num_requests_waiting 3",
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{model_name="m"} 1.5e3',
        'vllm:prefix_cache_hits_created{model_name="m"} 1.7e9',
        'vllm:prefix_cache_queries_total{model_name="m"} 4000',
        "vllm:num_requests_running_extra 99",
    ]) + "\n"
    assert metric_sums(text, NAMES) == reference(text)
    assert metric_sums(text, NAMES)["vllm:num_requests_running"] == 3.0


def test_line_reader_matches_prometheus_client_on_the_standin(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standin"))
    from harness import StandIn  # the faithful stand-in, real HTTP

    with StandIn() as server:
        body = json.dumps({"model": "qwen3.8-flash-next", "messages": [{"role": "user", "content": "hello there"}],
                           "max_tokens": 8, "temperature": 0}).encode()
        for _ in range(2):
            req = urllib.request.Request(f"{server.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()
        text = urllib.request.urlopen(f"{server.url}/metrics", timeout=30).read().decode()
    ours, ref = metric_sums(text, NAMES), reference(text)
    assert ours == ref and ref["vllm:prefix_cache_queries_total"] > 0
