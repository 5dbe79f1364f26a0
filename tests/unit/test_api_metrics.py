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


def by_label_reference(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and label in sample.labels:
                out[sample.labels[label]] = out.get(sample.labels[label], 0.0) + sample.value
    return out


PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def test_per_label_reader_matches_prometheus_client_on_tricky_text():
    from flash_cli.api import metric_by_label

    text = "\n".join([
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 90.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 10.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a,position=\\"9\\" }",position="1"} 60',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="2",model_name="m"} 3e1 1700000000000',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m"} 5',
        'vllm:spec_decode_num_accepted_tokens_per_pos_created{model_name="m",position="0"} 1.7e9',
    ]) + "\n"
    ours = metric_by_label(text, PER_POS, "position")
    assert ours == by_label_reference(text, PER_POS, "position") == {"0": 100.0, "1": 60.0, "2": 30.0}


def test_per_label_reader_matches_prometheus_client_on_the_standins_drafter():
    from flash_cli.api import metric_by_label

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standin"))
    from harness import StandIn

    with StandIn("--speculative-config", '{"method":"mtp","num_speculative_tokens":3}') as server:
        body = json.dumps({"model": "qwen3.8-flash-next", "messages": [{"role": "user", "content": "count to ten"}],
                           "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(f"{server.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=30).read()
        text = urllib.request.urlopen(f"{server.url}/metrics", timeout=30).read().decode()
    ours = metric_by_label(text, PER_POS, "position")
    assert ours == by_label_reference(text, PER_POS, "position")
    assert sorted(ours) == ["0", "1", "2"] and ours["0"] > ours["1"] > ours["2"] > 0


def test_status_turns_the_per_position_counters_into_rates_and_tokens_a_step_by_depth():
    from flash_cli.commands.status import mtp_by_position

    text = "\n".join(f'{PER_POS}{{model_name="m",position="{p}"}} {n}' for p, n in ((0, 80), (1, 56), (2, 30))) + "\n"
    got = mtp_by_position(text, drafts=100.0)
    assert got["mtp_acceptance_per_position"] == [0.8, 0.56, 0.3]
    # depth 1 keeps position 0's rate, depth 2 the first two: 1 + 0.8, 1 + 0.8 + 0.56, ...
    assert got["mtp_tokens_per_step_by_depth"] == [1.8, 2.36, 2.66]
    assert mtp_by_position(text, drafts=None) == {} and mtp_by_position(text, drafts=0.0) == {}
    assert mtp_by_position("", drafts=100.0) == {}
    gap = "\n".join(f'{PER_POS}{{position="{p}"}} 5' for p in (0, 2)) + "\n"
    assert mtp_by_position(gap, drafts=10.0) == {}   # a missing position: no depth can be read
    odd = f'{PER_POS}{{position="²"}} 5\n{PER_POS}{{position="0"}} 4\n{PER_POS}{{position="01"}} 2\n'
    assert mtp_by_position(odd, drafts=10.0)["mtp_acceptance_per_position"] == [0.4, 0.2]  # no crash on odd labels
