"""The bench's HTTP side: streamed greedy completions timed per stream, the spec-decode and PLE
counters read from /metrics around each measurement, one raw JSON row per measurement."""

from __future__ import annotations

import json
import statistics
import threading
import time

from flash_vllm.metrics_bridge import interval_s as bridge_interval_s  # stdlib only
from flash_vllm.ple.stats import COUNTERS as PLE_COUNTERS  # stdlib only


def read_counters(url: str, names: tuple[str, ...]) -> dict:
    """The named series' sums (exact sample names; flash_cli.api.metric_sums, checked against
    prometheus_client in the unit tier), zeros when the server cannot be read."""
    import requests

    from flash_cli.api import metric_sums

    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return {n: 0.0 for n in names}
    return {n: 0.0 for n in names} | metric_sums(text, names)

SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")


# patch 1's counters (flash_vllm.ple.stats.COUNTERS, as counter samples), on the API server's
# /metrics through the metrics bridge, which rewrites them at most once an interval (1 s by
# default): read after a settle of that interval and a margin
PLE = {k.removesuffix("_s"): PLE_COUNTERS[k][0] + "_total"
       for k in ("ops", "op_s", "gpu_wait_s", "dedup_s", "gather_s", "stage_s", "rows")}

PLE_SETTLE_S = bridge_interval_s({}) + 0.5


def ple_phases(before: dict, after: dict) -> dict | None:
    """Patch 1's lookups during one measurement: ops, and per op the ms of each phase and the rows
    (None when the server made none: stock, or counters not exposed)."""
    ops = after.get(PLE["ops"], 0.0) - before.get(PLE["ops"], 0.0)
    if ops <= 0:
        return None
    per = {f"{k}_ms_per_op": round((after.get(n, 0.0) - before.get(n, 0.0)) * 1000.0 / ops, 4)
           for k, n in PLE.items() if k not in ("ops", "rows")}
    return {"ops": int(ops), **per, "rows_per_op": round((after.get(PLE["rows"], 0.0) - before.get(PLE["rows"], 0.0)) / ops, 1)}


def sse_chunks(response):
    """The JSON chunks of an OpenAI-style server-sent event stream, up to `data: [DONE]`."""
    for line in response.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def stream_one(url: str, prompt: list[int], tokens: int, rec: dict) -> None:
    import requests

    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    rec["sent"] = time.perf_counter()
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return
            for chunk in sse_chunks(r):
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"].get("completion_tokens")
                if chunk.get("choices") and rec.get("first") is None:
                    rec["first"] = time.perf_counter()
    except requests.RequestException as exc:
        rec["error"] = str(exc)[:200]
    rec["end"] = time.perf_counter()


def measure(url: str, label: str, levels: list[int], tokens: int, repeats: int, sink) -> None:
    import random

    rng = random.Random(12)
    for rep in range(repeats):
        for conc in levels:
            measure_one(url, label, conc, tokens, rep, rng, sink)


def streams(url: str, conc: int, tokens: int, rng, prompt_len: int = 64) -> list[dict]:
    """`conc` requests at once, each a distinct random `prompt_len`-id prompt drawn from `rng` and
    `tokens` greedy tokens; one timing record per stream (stream_one's)."""
    recs = [{} for _ in range(conc)]
    threads = [threading.Thread(target=stream_one, args=(url, [rng.randrange(1000, 240000) for _ in range(prompt_len)], tokens,
                                                   recs[i]))
               for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return recs


def measure_one(url: str, label: str, conc: int, tokens: int, rep: int, rng, sink, extra: dict | None = None,
                settle_s: float = 0.0, prompt_len: int = 64) -> dict:
    """One measurement (`streams`, the spec-decode and PLE counters read around it): one raw row.
    `settle_s`: wait that long after the streams before the second read, so the PLE counters the
    metrics bridge carries (at most once a second) hold all of this measurement's lookups; the
    first read needs no wait when the server's previous measurement or warm-up settled too."""
    names = SPEC + tuple(PLE.values())
    before = read_counters(url, names)
    recs = streams(url, conc, tokens, rng, prompt_len)
    if settle_s:
        time.sleep(settle_s)
    after = read_counters(url, names)
    errors = [r["error"] for r in recs if "error" in r]
    row = {"label": label, "concurrency": conc, "repeat": rep, "max_tokens": tokens, "time": time.time(), **(extra or {})}
    if errors:
        row["error"] = errors[0]
    else:
        total = sum(r.get("tokens") or 0 for r in recs)
        wall = max(r["end"] for r in recs) - min(r["sent"] for r in recs)
        per = [((r["tokens"] or 0) - 1) / (r["end"] - r["first"]) for r in recs
               if r.get("first") and r["end"] > r["first"] and (r.get("tokens") or 0) > 1]
        drafts = after[SPEC[0]] - before[SPEC[0]]
        acc = after[SPEC[1]] - before[SPEC[1]]
        row.update(aggregate_tok_s=total / wall, per_stream_tok_s=statistics.median(per) if per else None,
                   tokens=total, wall_s=wall, ttft_s=statistics.median([r["first"] - r["sent"] for r in recs]),
                   mtp_drafts=drafts, mtp_accepted=acc, mtp_acceptance_length=(1 + acc / drafts) if drafts else None)
        ple = ple_phases(before, after)
        if ple:
            row["ple"] = ple
    sink(row)
    print(json.dumps(row), flush=True)
    return row


def warm(url: str, label: str, conc: int, tokens: int, sink, extra: dict | None = None, settle_s: float = 0.0,
         prompt_len: int = 64) -> None:
    """`conc` streams of `tokens` tokens, untimed for the results: one `warmup` event row (its wall
    time kept raw, so a slow first round shows), never summarized or paired. `settle_s` after it, as
    measure_one's: the first measurement's PLE counters then hold none of the warm-up's lookups."""
    import random

    rng = random.Random(7)  # its own prompts: the timed ones stay the same with or without it
    recs = streams(url, conc, tokens, rng, prompt_len)
    if settle_s:
        time.sleep(settle_s)
    row = {"label": label, "event": "warmup", "concurrency": conc, "max_tokens": tokens, **(extra or {}),
           "wall_s": round(max(r["end"] for r in recs) - min(r["sent"] for r in recs), 3)}
    errors = [r["error"] for r in recs if "error" in r]
    if errors:
        row["error"] = errors[0]
    sink(row)
    print(json.dumps(row), flush=True)


def jsonl_sink(path: str):
    def write(row: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return write


def parse_levels(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--levels {text!r}: give comma-separated integers, e.g. 1,4,8") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"--levels {text!r}: give comma-separated integers >= 1, e.g. 1,4,8")
    return vals
