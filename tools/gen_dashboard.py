#!/usr/bin/env python3
"""Generate the Grafana dashboard (observability/grafana/dashboards/flash.json) from the panel
list below. The JSON is an artifact: edit PANELS, run this, commit both. `--check` exits 1 when
the committed JSON is stale (CI runs it), `--queries` prints every PromQL query one per line
(the obs tier runs each against a real Prometheus and insists on data).

    python3 tools/gen_dashboard.py            # write
    python3 tools/gen_dashboard.py --check    # verify
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "observability" / "grafana" / "dashboards" / "flash.json"
DATASOURCE = {"type": "prometheus", "uid": "flash-prometheus"}  # fixed uid, provisioned with it
UID = "flash-qwen38"

# (row title, [(panel title, unit, kind, [(expr, legend)], description)])
PANELS = [
    ("Serving", [
        ("Server up", "none", "stat", [('up{job="vllm"}', "{{instance}}")],
         "1 when Prometheus can scrape the server's /metrics."),
        ("Decode and prefill throughput", "tokens/s", "timeseries", [
            ("flash:generation_tokens_per_second:rate1m", "decode {{model_name}}"),
            ("flash:prompt_tokens_per_second:rate1m", "prefill {{model_name}}")],
         "Tokens per second over 1m, all requests together (aggregate, not per stream)."),
        ("Requests running / waiting", "none", "timeseries", [
            ("sum by (model_name) (vllm:num_requests_running)", "running"),
            ("sum by (model_name) (vllm:num_requests_waiting)", "waiting")],
         "A waiting count that stays above 0 means SEQS or the KV cache is the limit."),
        ("KV cache usage", "percentunit", "timeseries", [
            ("max by (model_name) (vllm:kv_cache_usage_perc)", "{{model_name}}")],
         "Share of the KV pool held by running requests."),
        ("Prefix cache hit ratio", "percentunit", "timeseries", [
            ("flash:prefix_cache_hit_ratio:rate5m", "{{model_name}}")],
         "Prompt tokens served from the prefix cache / prompt tokens queried (5m)."),
        ("Time to first token", "s", "timeseries", [
            ("flash:time_to_first_token_seconds:p50_5m", "p50"),
            ("flash:time_to_first_token_seconds:p95_5m", "p95")],
         "Includes queueing and the whole prefill."),
        ("Inter-token latency and queue time", "s", "timeseries", [
            ("flash:inter_token_latency_seconds:p50_5m", "inter-token p50"),
            ("flash:request_queue_time_seconds:p95_5m", "queue p95")],
         "Decode step time seen by a stream, and time spent waiting for a slot."),
        ("MTP acceptance", "percentunit", "timeseries", [
            ("sum by (model_name) (rate(vllm:spec_decode_num_accepted_tokens_total[5m])) / "
             "sum by (model_name) (rate(vllm:spec_decode_num_draft_tokens_total[5m]))", "{{model_name}}")],
         "Accepted draft tokens / proposed draft tokens (only with MTP > 0)."),
        ("MTP tokens per step", "short", "timeseries", [
            ("flash:mtp_acceptance_length:rate5m", "{{model_name}}")],
         "Acceptance length: tokens a sequence gains per verification step (1 = no draft accepted). "
         "Decode tok/s is step rate times this; `flash bench` records it per point."),
        ("MTP acceptance by draft position", "percentunit", "timeseries", [
            ("sum by (model_name, position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total[5m])) "
             "/ on (model_name) group_left sum by (model_name) (rate(vllm:spec_decode_num_drafts_total[5m]))",
             "position {{position}}")],
         "Share of drafts whose draft at this position was accepted: falls with the position; a drop "
         "at every position at once points at the drafter (e.g. a reduced draft vocabulary on "
         "text it does not cover), a drop only at later positions at longer drafts than pay."),
    ]),
    ("PLE table (mmap)", [
        ("Host seconds per lookup", "s", "timeseries", [
            ("flash:ple_host_seconds_per_lookup:rate5m", "{{model_name}}")],
         "(op - gpu_wait) / lookups: what the lookup itself costs each step."),
        ("Page-cache health: gather share", "percentunit", "timeseries", [
            ("flash:ple_gather_share:rate5m", "{{model_name}}")],
         "Share of the lookup's own time spent reading rows. Climbs as the page cache is squeezed."),
        ("Table read bandwidth", "Bps", "timeseries", [
            ("flash:ple_read_bytes_per_second:rate5m", "{{model_name}}")],
         "Bytes per second gathered from the table (page cache or NVMe)."),
        ("Lookup time split", "s", "timeseries", [
            ("sum by (model_name) (rate(vllm:ple_mmap_gpu_wait_seconds_total[5m])) / sum by (model_name) (rate(vllm:ple_mmap_lookup_ops_total[5m]))", "gpu wait"),
            ("sum by (model_name) (rate(vllm:ple_mmap_dedup_seconds_total[5m])) / sum by (model_name) (rate(vllm:ple_mmap_lookup_ops_total[5m]))", "dedup"),
            ("sum by (model_name) (rate(vllm:ple_mmap_gather_seconds_total[5m])) / sum by (model_name) (rate(vllm:ple_mmap_lookup_ops_total[5m]))", "gather"),
            ("sum by (model_name) (rate(vllm:ple_mmap_stage_seconds_total[5m])) / sum by (model_name) (rate(vllm:ple_mmap_lookup_ops_total[5m]))", "stage")],
         "Seconds per lookup in each phase; gpu wait is GPU work queued ahead, not PLE cost."),
    ]),
    ("Host memory (node-exporter)", [
        ("Page cache vs available", "bytes", "timeseries", [
            ("node_memory_Cached_bytes", "Cached"),
            ("node_memory_MemAvailable_bytes", "MemAvailable")],
         "Nothing in vLLM's metrics shows the quantity that governs the gather cost: this does."),
        ("Swap and major faults", "ops", "timeseries", [
            ("rate(node_vmstat_pswpout[5m])", "pages swapped out/s"),
            ("rate(node_vmstat_pgmajfault[5m])", "major faults/s")],
         "Swapping out vLLM itself makes every step page-fault (keep vm.swappiness low)."),
    ]),
    ("Memory pressure (node-exporter)", [
        ("Memory stall share (PSI)", "percentunit", "timeseries", [
            ("flash:memory_pressure_some:rate5m", "some tasks stalled"),
            ("flash:memory_pressure_full:rate5m", "all tasks stalled")],
         "/proc/pressure/memory: share of time tasks waited on memory (direct reclaim, refaults). "
         "The FlashMemoryPressure alert fires above 10% for 10 minutes."),
        ("Direct reclaim", "ops", "timeseries", [
            ("rate(node_vmstat_pgscan_direct[5m])", "pages scanned by direct reclaim/s")],
         "Allocations that had to free memory themselves: on a full unified pool this burns the CPU "
         "the PLE gather needs."),
    ]),
    ("Memory guard (flash_common.memguard)", [
        ("PSI full avg10 vs the guard's line", "percent", "timeseries", [
            ("max by (name) (flash_guard_psi_full_avg10)", "full avg10 {{name}}"),
            ("max by (name) (flash_guard_threshold_percent)", "GUARD_PSI_FULL {{name}}")],
         "What the guard reads every 2 s (host: /proc/pressure/memory, container: the server's cgroup). Held "
         "above the line for GUARD_HOLD seconds, the server is stopped gracefully (docker stop)."),
        ("Guard: time above the line, stops", "short", "timeseries", [
            ("max by (name) (flash_guard_above_seconds)", "seconds above {{name}}"),
            ("max by (name) (flash_guard_hold_seconds)", "GUARD_HOLD {{name}}"),
            ("sum by (name) (flash_guard_stops_total)", "stops {{name}}")],
         "A stop's reason is the `reason` label of flash_guard_last_stop_timestamp_seconds (and `flash "
         "status`, and `docker logs NAME-guard`); the FlashGuardStoppedServer alert fires on a stop."),
    ]),
]


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in PANELS:
        panels.append({"type": "row", "id": pid, "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, kind, targets, desc) in enumerate(row_panels):
            w, h = 12, 8
            panel = {
                "type": kind, "id": pid, "title": title, "description": desc, "datasource": DATASOURCE,
                "gridPos": {"h": h, "w": w, "x": (i % 2) * w, "y": y + (i // 2) * h},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
                if kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"},
                "targets": [{"refId": chr(ord("A") + k), "datasource": DATASOURCE, "expr": expr,
                             "legendFormat": legend, "range": True} for k, (expr, legend) in enumerate(targets)],
            }
            panels.append(panel)
            pid += 1
        y += ((len(row_panels) + 1) // 2) * 8
    return {
        "uid": UID, "title": "flash: Qwen3.8-Flash-Next on vLLM", "tags": ["flash", "vllm"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "editable": False, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "templating": {"list": []}, "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def queries() -> list[str]:
    return [expr for _, row in PANELS for _, _, _, targets, _ in row for expr, _ in targets]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed JSON differs from the generated one")
    ap.add_argument("--queries", action="store_true", help="print every PromQL query of the dashboard")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.queries:
        print("\n".join(queries()))
        return 0
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != text:
            print(f"{args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} is stale: "
                  "run python3 tools/gen_dashboard.py and commit it", file=sys.stderr)
            return 1
        print(f"{args.out.name} is up to date ({len(queries())} queries)")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
