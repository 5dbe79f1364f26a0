#!/usr/bin/env python3
"""A faithful stand-in for `vllm serve` (STDLIB ONLY: it runs in a bare Debian rootfs with python3).

Usage, exactly like the real thing (the test image's /usr/local/bin/vllm execs this file):

    python3 tests/standin/server.py serve MODEL_PATH [--host H] [--port P] [any vllm serve flag ...]

What is faithful, and why it matters to the gates that run against it:
  * real HTTP on the same routes (/health, /v1/models, /v1/chat/completions, /v1/completions,
    /v1/messages, /tokenize, /version, /metrics), same JSON shapes, same error bodies and codes,
    the same Bearer check on /v1/* only (VLLM_API_KEY or --api-key);
  * nothing listens while "loading" (STANDIN_BOOT_SECONDS), like vLLM; boot log lines look like vLLM's;
  * /metrics is real Prometheus text exposition (v0.0.4, with *_created gauges like prometheus_client)
    whose counters really count: prefix-cache hits come from a block-hash prefix cache over the
    rendered prompt, running/waiting gauges follow the requests in flight (--max-num-seqs queues);
  * greedy output is a pure function of the rendered prompt (text AND logprobs), sampling
    with temperature > 0 is not;
  * SIGTERM: stop accepting, let in-flight requests finish quickly, exit 0.

Not a model: answers are deterministic filler words with a few canned facts. Knobs (env):
  STANDIN_BOOT_SECONDS (1)      load time before listening
  STANDIN_DIE_AT_BOOT=<code>    print an error during load and exit with <code>
  STANDIN_DELAY_MS (0)          extra milliseconds per generation request (spread over its tokens)
  STANDIN_DECODE_TPS (400)      single-stream decode speed, tokens/s
  STANDIN_PREFILL_TPS (20000)   prefill speed for prompt tokens not served from the prefix cache
  STANDIN_KV_TOKENS (1234567)   KV cache size in tokens
  STANDIN_TOKEN_CHARS (0)       >0: a small-vocabulary tokenizer: every word is cut into pieces of at most
                                this many characters (the tiny test model's 1,758-id byte-level BPE makes
                                ~3.5 tokens of a ledger word where Qwen's makes ~1.4): prompts sized by a
                                words-per-token estimate overshoot; /tokenize, the 400 and usage all agree
  STANDIN_STATS_SEC (10)        period of the engine stats log line (only when not idle)
  STANDIN_MAMBA_BLOCK_SIZE (0)  >0: a hybrid model's prefix cache, as vLLM 0.29 serves the tiny checkpoint
                                (run41): Mamba state is kept only every this many tokens (mamba_cache_mode
                                align), so hits are whole blocks of the larger of it and --block-size;
                                with --speculative-config the last hit block is recomputed (EAGLE/MTP
                                needs its hidden states); cache_config_info gains mamba_block_size
  STANDIN_SKIP_MODEL_CHECK=1    do not insist that an absolute MODEL_PATH exists
  STANDIN_FAULTS                comma list of fault switches:
      nondeterministic   greedy requests differ run to run (text and first-token logprobs)
      no_prefix_hits     the prefix cache never hits (queries still count)
      reject_high_effort reasoning effort high/max/minimal -> 400, like the unaliased template
      no_tool_calls      tools are ignored: plain text, never tool_calls
      slow               decode at ~8 tok/s (a swapping box)
      no_metrics         /metrics answers 404 (a server started without it / behind a proxy)
      no_tokenize        /tokenize answers 404 (a proxy that forwards only /v1/*)
      ple_engine_only    PLE counters only in multiprocess mode: what stock vLLM does with counters
                         registered in the EngineCore (measured, docs/OBSERVABILITY.md), i.e. a
                         server without flash_vllm's metrics bridge (FLASH_METRICS_BRIDGE=0)
      frozen_counters    token and request counters never move (registered in one process,
                         incremented in another)
      yarn_ignored       a --max-model-len above 262,144 does not take: the server falls back to
                         the native 262,144 ("Using max model len" twice, the second one 262,144),
                         the silent context fallback the field saw with a YaRN override
  STANDIN_KV_ALLOC_SECONDS (0)  print nothing for this long after the KV cache size line (a boot
                                hung in allocate_kv_cache)
  VLLM_PLE_MMAP=1               export the vllm:ple_mmap_* counters (VLLM_PLE_MMAP_PROMETHEUS=0: off)
                                exactly as flash_vllm's metrics bridge does in single-process mode
                                (and prometheus_client in multiprocess mode): unlabelled, the help
                                texts of flash_vllm/ple/stats.py (tests/unit/test_metrics_bridge.py)
  PROMETHEUS_MULTIPROC_DIR      set: *_created, process_* and python_* families vanish, as in vLLM's
                                multiprocess mode (measured: benchmarks/metrics/multiproc-diff-vllm-*.json)
  --kv-transfer-config          NixlConnector kv_producer: a request whose kv_transfer_params has
                                do_remote_decode answers (non-streaming) with the params vLLM 0.33's
                                nixl pull_scheduler.request_finished() returns (remote_host/port from
                                VLLM_NIXL_SIDE_CHANNEL_HOST/PORT); kv_consumer: a request with
                                do_remote_prefill is served as usual. Both record the params they got
                                (GET /standin/argv: kv_seen) and refuse the wrong side's params (400).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import resource
import signal
import sys
import threading
import time
import uuid
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = "0.33.0+standin"
FAULT_NAMES = ("yarn_ignored", "nondeterministic", "no_prefix_hits", "reject_high_effort", "no_tool_calls", "slow", "no_metrics",
               "ple_engine_only", "frozen_counters", "no_tokenize")
ACCEPTED_EFFORTS = ("low", "medium", "xhigh")  # what the Qwen3.8-Flash-Next template itself accepts
ALIASED_EFFORTS = {"high": "xhigh", "max": "xhigh", "minimal": "low"}  # EFFORT_ALIAS=1 rewrites these
BLOCK_SIZE = 16  # vLLM's default; --block-size sets it (the prefix cache hits whole blocks only)
START = time.time()


# ---------------------------------------------------------------------------------------------
# logging that looks like vLLM's
def log(level: str, where: str, msg: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"(APIServer pid={os.getpid()}) {level} {stamp} [{where}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# argv: the flags we act on; everything else is accepted and recorded
def parse_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="vllm", allow_abbrev=False, add_help=False)
    p.add_argument("subcommand", choices=["serve"])
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true", default=True)
    p.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--speculative-config")
    p.add_argument("--api-key")
    p.add_argument("--reasoning-parser")
    p.add_argument("--enable-log-requests", action="store_true")
    p.add_argument("--enable-log-outputs", action="store_true")
    # multi-node ranks (vLLM's names and defaults: ParallelConfig, cli_args.make_arg_parser)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--nnodes", "-n", type=int, default=1)
    p.add_argument("--node-rank", "-r", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--data-parallel-size-local", type=int)
    p.add_argument("--data-parallel-start-rank", type=int)
    p.add_argument("--data-parallel-address")
    p.add_argument("--data-parallel-rpc-port", type=int, default=29550)
    p.add_argument("--kv-transfer-config")
    ns, unknown = p.parse_known_args(argv)
    ns.model = ns.model_tag or ns.model
    if not ns.model:
        p.error("the following arguments are required: model_tag")
    return ns, unknown


# ---------------------------------------------------------------------------------------------
# a tokenizer-shaped splitter: words, digit groups of <=3 (like BPE vocabularies), punctuation
TOKEN_RE = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]|\s+|_")


TOKEN_CHARS = int(os.environ.get("STANDIN_TOKEN_CHARS") or 0)


def tokenize(text: str) -> list[str]:
    toks = TOKEN_RE.findall(text)
    if TOKEN_CHARS > 0:
        toks = [t[i:i + TOKEN_CHARS] for t in toks for i in range(0, len(t), TOKEN_CHARS)]
    return toks


def token_id(tok: str) -> int:
    return int.from_bytes(hashlib.blake2b(tok.encode(), digest_size=4).digest(), "big") % 151_000


def render_chatml(messages: list[dict], tools: list | None = None) -> str:
    """Qwen's ChatML, what vLLM feeds the engine (and logs with --enable-log-requests)."""
    out = []
    sys_text = ""
    if messages and messages[0].get("role") == "system":
        sys_text = content_text(messages[0].get("content"))
        messages = messages[1:]
    if tools:
        sys_text += ("\n\n" if sys_text else "") + "# Tools\n" + json.dumps(tools, sort_keys=True)
    if sys_text:
        out.append(f"<|im_start|>system\n{sys_text}<|im_end|>\n")
    for m in messages:
        role = m.get("role", "user")
        text = content_text(m.get("content"))
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            text += f"\n<tool_call>\n{json.dumps({'name': fn.get('name'), 'arguments': fn.get('arguments')})}\n</tool_call>"
        if role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif block.get("type") == "tool_result":
            parts.append(content_text(block.get("content")))
        elif block.get("type") == "tool_use":
            parts.append(json.dumps({"name": block.get("name"), "arguments": block.get("input")}))
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# "generation": a pure function of the prompt (greedy) with a few facts so coherence checks mean something
FILLER = ("the cache keeps hot pages in memory while cold rows are read from disk when a request "
          "needs them and the kernel decides which pages to drop under pressure so the working set "
          "matters more than the table size because every token reads a few small rows").split()
FACTS = (
    ("capital of france", " Paris. Paris is the capital and most populous city of France, on the Seine."),
    ("haiku", "\nSilent pages wait\nrows wake when the prompt arrives\ncache holds what it can"),
    ("palindrome", "\n```python\ndef is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n```"),
    ("hamlet", " Prince Hamlet learns that his uncle Claudius murdered his father. He feigns madness while he tests the truth. His revenge costs Ophelia, Polonius and finally his own life. Fortinbras inherits a court of corpses."),
    ("2+2", " 4."),
)


def natural_length(prompt: str, seed: int) -> int:
    m = re.search(r"(\d{2,4})\s+words", prompt)
    if m:
        return max(8, int(int(m.group(1)) * 1.3))
    return 24 + seed % 96


def greedy_tokens(prompt: str, tail: str) -> list[str]:
    """The greedy continuation: facts first, then filler chosen by a hash of the prompt."""
    digest = hashlib.sha256(prompt.encode()).digest()
    seed = int.from_bytes(digest[:8], "big")
    low = tail.lower()
    text = ""
    for key, answer in FACTS:
        if key in low:
            text = answer
            break
    toks = tokenize(text)
    rng = random.Random(seed)
    n = max(natural_length(tail, seed), len(toks))
    while len(toks) < n:
        toks.append(" " + rng.choice(FILLER))
    if text == "" or len(toks) > len(tokenize(text)):
        toks.append(".")
    return toks


def sampled_tokens(prompt: str, tail: str, temperature: float, seed) -> list[str]:
    rng = random.Random(seed) if seed is not None else random.Random()
    base = greedy_tokens(prompt, tail)
    out = []
    for tok in base:
        out.append(" " + rng.choice(FILLER) if rng.random() < min(0.9, temperature * 0.5) else tok)
    return out


def logprob_entries(prompt: str, toks: list[str], top_n: int, jitter: float = 0.0) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Per generated token: (token, logprob, top alternatives) — deterministic in the prefix."""
    out = []
    h = hashlib.sha256(prompt.encode())
    for tok in toks:
        h.update(tok.encode())
        d = h.digest()
        lp = -(d[0] / 255.0) * 0.6 - 1e-4 + jitter
        tops = [(tok, lp)]
        for i in range(1, max(top_n, 1)):
            alt = " " + FILLER[d[i] % len(FILLER)]
            if alt == tok:
                alt = alt + "s"
            tops.append((alt, lp - 1.0 - i * 0.7 - d[i + 8] / 255.0))
        out.append((tok, lp, tops[: max(top_n, 0)]))
    return out


# ---------------------------------------------------------------------------------------------
# Prometheus text exposition (format 0.0.4, as prometheus_client writes it)
def fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if v != v:
        return "NaN"
    return repr(float(v))


def labelstr(labels: dict) -> str:
    if not labels:
        return ""
    esc = lambda s: str(s).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


class Family:
    def __init__(self, name: str, kind: str, doc: str, buckets: tuple = ()):
        self.name, self.kind, self.doc = name, kind, doc
        self.buckets = tuple(buckets) + (math.inf,) if buckets else ()
        self.samples: dict[tuple, dict] = {}

    def child(self, labels: dict) -> dict:
        key = tuple(sorted(labels.items()))
        if key not in self.samples:
            self.samples[key] = {"labels": dict(labels), "value": 0.0, "created": time.time(),
                                 "counts": [0] * len(self.buckets), "sum": 0.0}
        return self.samples[key]


class Registry:
    def __init__(self):
        self.lock = threading.Lock()
        self.families: OrderedDict[str, Family] = OrderedDict()

    def family(self, name: str, kind: str, doc: str, buckets: tuple = ()) -> Family:
        if name not in self.families:
            self.families[name] = Family(name, kind, doc, buckets)
        return self.families[name]

    def inc(self, name: str, labels: dict, amount: float = 1.0) -> None:
        with self.lock:
            self.families[name].child(labels)["value"] += amount

    def set(self, name: str, labels: dict, value: float) -> None:
        with self.lock:
            self.families[name].child(labels)["value"] = value

    def observe(self, name: str, labels: dict, value: float) -> None:
        with self.lock:
            fam = self.families[name]
            c = fam.child(labels)
            for i, b in enumerate(fam.buckets):
                if value <= b:
                    c["counts"][i] += 1
            c["sum"] += value

    def exposition(self, created: bool) -> str:
        lines = []
        with self.lock:
            for fam in self.families.values():
                esc_doc = fam.doc.replace("\\", r"\\").replace("\n", r"\n")
                shown = fam.name + "_total" if fam.kind == "counter" else fam.name
                lines.append(f"# HELP {shown} {esc_doc}")
                lines.append(f"# TYPE {shown} {fam.kind}")
                for c in fam.samples.values():
                    lab = c["labels"]
                    if fam.kind == "histogram":
                        for b, n in zip(fam.buckets, c["counts"]):
                            lines.append(f"{fam.name}_bucket{labelstr({**lab, 'le': fmt(b)})} {fmt(n)}")
                        lines.append(f"{fam.name}_count{labelstr(lab)} {fmt(c['counts'][-1])}")
                        lines.append(f"{fam.name}_sum{labelstr(lab)} {fmt(c['sum'])}")
                    else:
                        lines.append(f"{shown}{labelstr(lab)} {fmt(c['value'])}")
                if created and fam.kind in ("counter", "histogram") and fam.samples:
                    lines.append(f"# HELP {fam.name}_created {esc_doc}")
                    lines.append(f"# TYPE {fam.name}_created gauge")
                    for c in fam.samples.values():
                        lines.append(f"{fam.name}_created{labelstr(c['labels'])} {fmt(c['created'])}")
        return "\n".join(lines) + "\n"


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000,
                 200000, 500000, 1000000)
# As flash_vllm/ple/stats.py declares them (names, help) and the metrics bridge exposes them: no labels.
PLE_COUNTERS = (
    ("vllm:ple_mmap_lookup_ops", "PLE mmap lookups (one per forward of the PLE layer)"),
    ("vllm:ple_mmap_op_seconds", "Seconds in PLE lookups end to end (ids, gather, H2D)"),
    ("vllm:ple_mmap_gpu_wait_seconds", "Seconds waiting for the GPU before a lookup"),
    ("vllm:ple_mmap_dedup_seconds", "Seconds deduplicating row ids"),
    ("vllm:ple_mmap_gather_seconds", "Seconds reading rows from the table (disk/page cache)"),
    ("vllm:ple_mmap_stage_seconds", "Seconds staging rows to the device"),
    ("vllm:ple_mmap_rows", "Table rows read"),
    ("vllm:ple_mmap_bytes", "Table bytes read"),
)
PLE_START_GAUGE = ("vllm:ple_mmap_engine_start_time_seconds", "Unix time the PLE engine started (restart marker)")


# ---------------------------------------------------------------------------------------------
class Engine:
    """Scheduler-shaped state: running/waiting, a prefix cache of block hashes, metrics."""

    def __init__(self, ns: argparse.Namespace, env: dict):
        self.ns = ns
        self.env = env
        self.faults = {f.strip() for f in env.get("STANDIN_FAULTS", "").split(",") if f.strip()}
        bad = self.faults - set(FAULT_NAMES)
        if bad:
            raise SystemExit(f"STANDIN_FAULTS: unknown fault(s) {sorted(bad)}; known: {', '.join(FAULT_NAMES)}")
        self.model_name = (ns.served_model_name or [ns.model])[0]
        self.aliases = ns.served_model_name or [ns.model]
        self.max_model_len = ns.max_model_len or 262144
        self.kv_tokens = int(env.get("STANDIN_KV_TOKENS", "1234567"))
        self.decode_tps = float(env.get("STANDIN_DECODE_TPS", "400"))
        if "slow" in self.faults:
            self.decode_tps = 8.0
        self.prefill_tps = float(env.get("STANDIN_PREFILL_TPS", "20000"))
        self.delay_s = float(env.get("STANDIN_DELAY_MS", "0")) / 1000.0
        self.api_key = ns.api_key or env.get("VLLM_API_KEY") or None
        self.multiproc = bool(env.get("PROMETHEUS_MULTIPROC_DIR"))
        self.ple = env.get("VLLM_PLE_MMAP") == "1" and env.get("VLLM_PLE_MMAP_PROMETHEUS", "1") != "0"
        if "ple_engine_only" in self.faults and not self.multiproc:
            self.ple = False
        self.cond = threading.Condition()
        self.running = 0
        self.waiting = 0
        self.running_tokens = 0
        self.stopping = False
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.block_size = max(1, ns.block_size)
        self.mamba_block_size = int(env.get("STANDIN_MAMBA_BLOCK_SIZE") or 0)
        self.cache_blocks = max(1, self.kv_tokens // self.block_size)
        self.window = {"prompt": 0, "gen": 0, "q": 0, "h": 0}
        spec = json.loads(ns.speculative_config) if ns.speculative_config else {}
        self.spec_k = int(spec.get("num_speculative_tokens") or 1)
        self.reg = Registry()
        self._declare_metrics()
        kv_cfg = json.loads(ns.kv_transfer_config) if ns.kv_transfer_config else {}
        self.kv_role = kv_cfg.get("kv_role")
        self.engine_id = str(uuid.uuid4())
        self.kv_seen: list[dict] = []

    def kv_handoff(self, body: dict, rid: str, n_prompt: int) -> dict | None:
        """The NixlConnector's part of one request (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
        base_scheduler.on_new_request, pull_scheduler.request_finished): what the answer carries."""
        kv = body.get("kv_transfer_params")
        if not isinstance(kv, dict):
            return None
        self.kv_seen = (self.kv_seen + [kv])[-20:]
        if kv.get("do_remote_decode"):
            if self.kv_role != "kv_producer":
                raise ApiError(400, f"do_remote_decode sent to a {self.kv_role or 'non-P/D'} server", param="kv_transfer_params")
            return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                    "remote_engine_id": self.engine_id, "remote_request_id": rid,
                    "remote_host": self.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
                    "remote_port": int(self.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")), "tp_size": 1,
                    "dcp_size": 1, "pp_size": 1, "remote_num_tokens": n_prompt, "remote_blocks_expiry_time": None,
                    "remote_registration_generation": 0, "transfer_mode": "pull"}
        if kv.get("do_remote_prefill") and self.kv_role != "kv_consumer":
            raise ApiError(400, f"do_remote_prefill sent to a {self.kv_role or 'non-P/D'} server", param="kv_transfer_params")
        return None

    # -- metrics ------------------------------------------------------------------------------
    @property
    def labels(self) -> dict:
        return {"engine": "0", "model_name": self.model_name}

    def _declare_metrics(self) -> None:
        r, L = self.reg, self.labels
        for name, doc in (
            ("vllm:num_requests_running", "Number of requests in model execution batches."),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
        ):
            r.family(name, "gauge", doc).child(L)
        r.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig").child(
            {**L, "block_size": str(self.block_size), "enable_prefix_caching": str(self.ns.prefix_caching),
             "num_gpu_blocks": str(self.cache_blocks),
             **({"mamba_block_size": str(self.mamba_block_size), "mamba_cache_mode": "align"}
                if self.mamba_block_size else {})})["value"] = 1.0
        for name, doc in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
            ("vllm:prompt_tokens", "Number of prefill tokens processed."),
            ("vllm:generation_tokens", "Number of generation tokens processed."),
        ):
            r.family(name, "counter", doc).child(L)
        fam = r.family("vllm:request_success", "counter", "Count of successfully processed requests.")
        for reason in ("stop", "length", "abort"):
            fam.child({**L, "finished_reason": reason})
        for name, doc, b in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS),
            ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS),
        ):
            r.family(name, "histogram", doc, b).child(L)
        if self.ns.speculative_config:
            for name, doc in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
            ):
                r.family(name, "counter", doc).child(L)
            per_pos = r.family("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "counter", "Accepted tokens per draft position.")
            for pos in range(self.spec_k):
                per_pos.child({**L, "position": str(pos)})
        if self.ple:
            for name, doc in PLE_COUNTERS:
                r.family(name, "counter", doc).child({})
            r.family(PLE_START_GAUGE[0], "gauge", PLE_START_GAUGE[1]).child({})["value"] = time.time()

    def process_metrics(self) -> str:
        """process_* like prometheus_client's ProcessCollector (Linux /proc)."""
        lines = []
        try:
            with open("/proc/self/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            ticks = os.sysconf("SC_CLK_TCK")
            page = resource.getpagesize()
            with open("/proc/stat") as f:
                btime = next(float(l.split()[1]) for l in f if l.startswith("btime"))
            vals = (
                ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", float(parts[20])),
                ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", float(parts[21]) * page),
                ("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
                 btime + float(parts[19]) / ticks),
                ("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.",
                 (float(parts[11]) + float(parts[12])) / ticks),
                ("process_open_fds", "gauge", "Number of open file descriptors.", float(len(os.listdir("/proc/self/fd")))),
                ("process_max_fds", "gauge", "Maximum number of open file descriptors.",
                 float(resource.getrlimit(resource.RLIMIT_NOFILE)[0])),
            )
        except (OSError, StopIteration, IndexError):
            return ""
        for name, kind, doc, v in vals:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {fmt(v)}"]
        lines += ["# HELP python_info Python platform information", "# TYPE python_info gauge",
                  'python_info{implementation="%s",major="%d",minor="%d",patchlevel="%d",version="%s"} 1.0'
                  % (sys.implementation.name, *sys.version_info[:3], "%d.%d.%d" % sys.version_info[:3])]
        return "\n".join(lines) + "\n"

    def metrics_text(self) -> str:
        with self.cond:
            self.reg.set("vllm:num_requests_running", self.labels, self.running)
            self.reg.set("vllm:num_requests_waiting", self.labels, self.waiting)
            self.reg.set("vllm:kv_cache_usage_perc", self.labels, min(1.0, self.running_tokens / self.kv_tokens))
        # multiprocess mode (vLLM's get_prometheus_registry): a fresh registry holding only the
        # MultiProcessCollector, so process_*/python_* and every *_created family disappear
        # (measured on vLLM 0.29-0.31, benchmarks/metrics/multiproc-diff-vllm-*.json)
        if self.multiproc:
            return self.reg.exposition(created=False)
        return self.process_metrics() + self.reg.exposition(created=True)

    # -- prefix cache -------------------------------------------------------------------------
    def prefix_lookup(self, token_ids: list[int]) -> int:
        """Returns the number of prompt tokens served from cache and inserts the prompt's blocks.
        Like vLLM: whole blocks only, never the last prompt token (one must be computed)."""
        hits = 0
        h = b""
        bs = max(self.block_size, self.mamba_block_size)  # a hybrid model hits whole Mamba blocks only
        full = (len(token_ids) - 1) // bs
        with self.cond:
            hitting = self.ns.prefix_caching and "no_prefix_hits" not in self.faults
            for b in range(len(token_ids) // bs):
                h = hashlib.blake2b(h + repr(token_ids[b * bs:(b + 1) * bs]).encode(), digest_size=16).digest()
                if hitting and b < full and hits == b * bs and h in self.cache:
                    hits += bs
                    self.cache.move_to_end(h)
                elif self.ns.prefix_caching:
                    self.cache[h] = None
            while len(self.cache) > self.cache_blocks:
                self.cache.popitem(last=False)
        if self.mamba_block_size and self.ns.speculative_config and hits:
            hits -= bs  # the drafter needs the last block's hidden states: recomputed (drop_eagle_block)
        if self.ns.prefix_caching:
            self.reg.inc("vllm:prefix_cache_queries", self.labels, len(token_ids))
            self.reg.inc("vllm:prefix_cache_hits", self.labels, hits)
        self.window["q"] += len(token_ids)
        self.window["h"] += hits
        return hits

    # -- request lifecycle --------------------------------------------------------------------
    def admit(self, n_prompt: int) -> float:
        arrived = time.monotonic()
        with self.cond:
            self.waiting += 1
            while self.running >= self.ns.max_num_seqs and not self.stopping:
                self.cond.wait(0.05)
            self.waiting -= 1
            self.running += 1
            self.running_tokens += n_prompt
        return time.monotonic() - arrived

    def release(self, n_tokens: int) -> None:
        with self.cond:
            self.running -= 1
            self.running_tokens -= n_tokens
            self.cond.notify_all()

    def pause(self, seconds: float) -> None:
        """Sleep that ends early when SIGTERM asks in-flight requests to finish quickly."""
        end = time.monotonic() + seconds
        while not self.stopping:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    def token_period(self) -> float:
        # batching: one more running sequence costs each stream ~12% (a memory-bound decode step)
        return (1.0 / self.decode_tps) * (1.0 + 0.12 * max(0, self.running - 1))

    def ple_account(self, tokens: int, steps: int) -> None:
        if not self.ple or tokens <= 0:
            return
        rows = tokens * 16
        gather = rows * 2.0e-7
        dedup, stage, gpu_wait = rows * 2.0e-8, rows * 4.0e-8, steps * 0.004
        for name, v in (("lookup_ops", steps), ("rows", rows), ("bytes", rows * 160), ("gather_seconds", gather),
                        ("dedup_seconds", dedup), ("stage_seconds", stage), ("gpu_wait_seconds", gpu_wait),
                        ("op_seconds", gather + dedup + stage + gpu_wait + steps * 0.0005)):
            self.reg.inc(f"vllm:ple_mmap_{name}", {}, v)

    def finish(self, n_prompt: int, n_gen: int, reason: str, t: dict) -> None:
        L = self.labels
        if "frozen_counters" not in self.faults:
            self.reg.inc("vllm:prompt_tokens", L, n_prompt)
            self.reg.inc("vllm:generation_tokens", L, n_gen)
            self.reg.inc("vllm:request_success", {**L, "finished_reason": reason})
        self.reg.observe("vllm:request_prompt_tokens", L, n_prompt)
        self.reg.observe("vllm:request_generation_tokens", L, n_gen)
        self.reg.observe("vllm:e2e_request_latency_seconds", L, t["end"] - t["arrived"])
        self.reg.observe("vllm:request_queue_time_seconds", L, t["queued"])
        self.reg.observe("vllm:request_prefill_time_seconds", L, t["first"] - t["scheduled"])
        self.reg.observe("vllm:request_decode_time_seconds", L, t["end"] - t["first"])
        if self.ns.speculative_config and n_gen:
            # A drafter whose acceptance decays with the position (0.9, 0.7, 0.5, …): MTP=2 accepts 1.6
            # tokens per draft, an acceptance length of 2.6; per position as vLLM's V1 counters split it.
            drafts = max(1, n_gen // 3)
            per_pos = [int(drafts * max(0.1, 0.9 - 0.2 * pos)) for pos in range(self.spec_k)]
            self.reg.inc("vllm:spec_decode_num_drafts", L, drafts)
            self.reg.inc("vllm:spec_decode_num_draft_tokens", L, drafts * self.spec_k)
            self.reg.inc("vllm:spec_decode_num_accepted_tokens", L, sum(per_pos))
            for pos, n in enumerate(per_pos):
                self.reg.inc("vllm:spec_decode_num_accepted_tokens_per_pos", {**L, "position": str(pos)}, n)
        self.window["prompt"] += n_prompt
        self.window["gen"] += n_gen

    def generate(self, prompt: str, tail: str, params: dict, emit, forced: list[str] | None = None) -> dict:
        """Run one request. `emit(index, token)` is called per token as it is produced (streaming).
        Returns {tokens, finish_reason, n_prompt, cached, logprobs}."""
        prompt_toks = tokenize(prompt)
        ids = [token_id(t) for t in prompt_toks]
        n_prompt = len(ids)
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, "
                           f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
                           param="max_tokens")
        temperature = params.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        greedy = temperature == 0.0
        if forced is not None:
            toks = list(forced)
        elif greedy:
            toks = greedy_tokens(prompt, tail)
        else:
            toks = sampled_tokens(prompt, tail, temperature, params.get("seed"))
        if greedy and forced is None and "nondeterministic" in self.faults:
            # what a non-deterministic top-k kernel looks like from outside: logprob noise and,
            # now and then, a different argmax somewhere in the answer
            rng = random.Random()
            pos = rng.randrange(len(toks))
            toks[pos] = " " + rng.choice(FILLER) + rng.choice(("", "s", "ed"))
        stop = params.get("stop") or []
        finish = "stop"
        if len(toks) > max_tokens:
            toks, finish = toks[:max_tokens], "length"
        if stop:
            text = "".join(toks)
            cut = min((text.find(s) for s in stop if s and text.find(s) >= 0), default=-1)
            if cut >= 0:
                kept, acc = [], ""
                for t in toks:
                    if len(acc) + len(t) > cut:
                        break
                    kept.append(t)
                    acc += t
                toks, finish = kept, "stop"
        t = {"arrived": time.monotonic()}
        t["queued"] = self.admit(n_prompt)
        t["scheduled"] = time.monotonic()
        try:
            cached = self.prefix_lookup(ids)
            new = n_prompt - cached
            self.pause(new / self.prefill_tps + self.delay_s / 2)
            self.ple_account(new, max(1, math.ceil(new / 8192)))
            t["first"] = time.monotonic()
            self.reg.observe("vllm:time_to_first_token_seconds", self.labels, t["first"] - t["arrived"])
            per_tok_delay = (self.delay_s / 2) / max(1, len(toks))
            last = t["first"]
            for i, tok in enumerate(toks):
                if i:
                    self.pause(self.token_period() + per_tok_delay)
                    now = time.monotonic()
                    self.reg.observe("vllm:inter_token_latency_seconds", self.labels, now - last)
                    last = now
                with self.cond:
                    self.running_tokens += 1
                emit(i, tok)
            self.ple_account(len(toks), len(toks))
            t["end"] = time.monotonic()
        finally:
            self.release(n_prompt + len(toks))
        self.finish(n_prompt, len(toks), finish, t)
        return {"tokens": toks, "finish_reason": finish, "n_prompt": n_prompt, "cached": cached}

    def stats_loop(self, period: float) -> None:
        last = time.monotonic()
        while True:
            time.sleep(period)
            now = time.monotonic()
            w, self.window = self.window, {"prompt": 0, "gen": 0, "q": 0, "h": 0}
            if not (w["prompt"] or w["gen"] or self.running or self.waiting):
                last = now
                continue
            dt = now - last
            last = now
            rate = 100.0 * w["h"] / w["q"] if w["q"] else 0.0
            log("INFO", "loggers.py:127",
                f"Engine 000: Avg prompt throughput: {w['prompt'] / dt:.1f} tokens/s, Avg generation throughput: "
                f"{w['gen'] / dt:.1f} tokens/s, Running: {self.running} reqs, Waiting: {self.waiting} reqs, "
                f"GPU KV cache usage: {100.0 * self.running_tokens / self.kv_tokens:.1f}%, Prefix cache hit rate: {rate:.1f}%")


class ApiError(Exception):
    def __init__(self, code: int, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    def body(self) -> dict:
        kind = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError"}.get(self.code, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------
def check_effort(engine: Engine, effort) -> None:
    if effort is None:
        return
    if effort in ACCEPTED_EFFORTS:
        return
    if effort in ALIASED_EFFORTS and "reject_high_effort" not in engine.faults:
        return
    # the exact failure the stock template raises while rendering
    raise ApiError(400, f"Unexpected reasoning effort {effort}. Supported types are xhigh (default), medium, and low.")


def tool_arguments(tool: dict, user_text: str) -> dict:
    """Fill the tool's required parameters from the question, deterministically."""
    params = (tool.get("function") or tool).get("parameters") or tool.get("input_schema") or {}
    props = params.get("properties") or {}
    names = params.get("required") or list(props)[:1]
    caps = [w for w in re.findall(r"\b[A-Z][a-zA-Z]+\b", user_text)[1:]] or ["Paris"]
    numbers = re.findall(r"-?\d+(?:\.\d+)?", user_text)
    args = {}
    for i, name in enumerate(names):
        spec = props.get(name, {})
        kind = spec.get("type", "string")
        if "enum" in spec:
            args[name] = spec["enum"][0]
        elif kind in ("integer", "number"):
            v = float(numbers[i % len(numbers)]) if numbers else 1
            args[name] = int(v) if kind == "integer" else v
        elif kind == "boolean":
            args[name] = True
        else:
            args[name] = caps[i % len(caps)]
    return args


def pick_tool(engine: Engine, tools: list | None, tool_choice, last_role: str) -> dict | None:
    if not tools or "no_tool_calls" in engine.faults or tool_choice == "none" or last_role not in ("user",):
        return None
    if isinstance(tool_choice, dict):
        want = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        for t in tools:
            if (t.get("function") or t).get("name") == want:
                return t
    return tools[0]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    engine: Engine = None  # set by main
    argv: list[str] = []
    ns: argparse.Namespace = None
    rank_plan: dict | None = None
    unknown: list[str] = []

    def log_message(self, fmt_: str, *args) -> None:
        # uvicorn's access log line, as vLLM prints it
        from http import HTTPStatus
        code = args[1] if len(args) > 1 else ""
        try:
            phrase = HTTPStatus(int(code)).phrase
        except ValueError:
            phrase = ""
        print(f'(APIServer pid={os.getpid()}) INFO:     {self.client_address[0]}:{self.client_address[1]} - '
              f'"{self.command} {self.path} HTTP/1.1" {code} {phrase}', flush=True)

    # -- plumbing -----------------------------------------------------------------------------
    def send_json(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_text(self, code: int, text: str, ctype: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def drain(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        if n:
            self.rfile.read(n)

    def read_json(self) -> dict:
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            obj = json.loads(raw or b"{}")
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"JSON decode error: {exc}")
        if not isinstance(obj, dict):
            raise ApiError(400, "Input should be a valid dictionary")
        return obj

    def authorized(self) -> bool:
        key = self.engine.api_key
        if not key or not self.path.startswith("/v1"):
            return True
        return self.headers.get("authorization", "") == f"Bearer {key}"

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model not in self.engine.aliases:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model")

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True

    def sse(self, obj, event: str | None = None) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        head = f"event: {event}\n" if event else ""
        self.wfile.write(f"{head}data: {data}\n\n".encode())
        self.wfile.flush()

    def dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        routes = {
            ("GET", "/health"): self.r_health,
            ("GET", "/ping"): self.r_health,
            ("GET", "/version"): lambda: self.send_json(200, {"version": VERSION}),
            ("GET", "/metrics"): self.r_metrics,
            ("GET", "/v1/models"): self.r_models,
            ("POST", "/v1/chat/completions"): self.r_chat,
            ("POST", "/v1/completions"): self.r_completions,
            ("POST", "/v1/messages"): self.r_messages,
            ("POST", "/tokenize"): self.r_tokenize,
            ("GET", "/standin/argv"): self.r_argv,
        }
        try:
            if not self.authorized():
                self.send_json(401, {"error": "Unauthorized"})
                return
            if path == "/tokenize" and "no_tokenize" in self.engine.faults:
                routes = {k: v for k, v in routes.items() if k[1] != path}
            fn = routes.get((method, path))
            if fn is None:
                self.drain()  # an unread body would be parsed as the next request on this keep-alive connection
                if any(p == path for _, p in routes):
                    self.send_json(405, {"detail": "Method Not Allowed"})
                else:
                    self.send_json(404, {"detail": "Not Found"})
                return
            fn()
        except ApiError as exc:
            self.send_json(exc.code, exc.body())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:
        self.dispatch("GET")

    def do_POST(self) -> None:
        self.dispatch("POST")

    # -- routes -------------------------------------------------------------------------------
    def r_health(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def r_metrics(self) -> None:
        if "no_metrics" in self.engine.faults:
            self.send_json(404, {"detail": "Not Found"})
            return
        self.send_text(200, self.engine.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")

    def r_argv(self) -> None:
        ns = self.ns
        self.send_json(200, {
            "argv": self.argv, "unknown": self.unknown, "model": ns.model, "host": ns.host, "port": ns.port,
            "served_model_name": ns.served_model_name, "max_model_len": ns.max_model_len,
            "enable_prefix_caching": ns.prefix_caching, "speculative_config": ns.speculative_config,
            "api_key_required": bool(self.engine.api_key), "faults": sorted(self.engine.faults),
            "pid": os.getpid(), "ranks": self.rank_plan, "kv_transfer_config": ns.kv_transfer_config,
            "kv_seen": self.engine.kv_seen,
        })

    def r_models(self) -> None:
        created = int(START)
        self.send_json(200, {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": self.ns.model,
             "parent": None, "max_model_len": self.engine.max_model_len,
             "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                             "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                             "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                             "organization": "*", "group": None, "is_blocking": False}]}
            for name in self.engine.aliases]})

    def r_tokenize(self) -> None:
        """vLLM's POST /tokenize (0.33: vllm/entrypoints/serve/tokenize/): {"model"?, "prompt"} or
        {"model"?, "messages"} -> {"count", "max_model_len", "tokens", "token_strs"}; the count is
        exactly what a /v1/completions request with the same prompt is charged."""
        body = self.read_json()
        self.check_model(body)
        prompt = body.get("prompt")
        if prompt is None:
            if not isinstance(body.get("messages"), list):
                raise ApiError(400, "Field required: 'prompt' or 'messages'", param="prompt")
            prompt = render_chatml(body["messages"])
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt: Input should be a valid string", param="prompt")
        pieces = tokenize(prompt)
        self.send_json(200, {"count": len(pieces), "max_model_len": self.engine.max_model_len,
                             "tokens": [token_id(t) for t in pieces],
                             "token_strs": pieces if body.get("return_token_strs") else None})

    def log_inputs(self, rid: str, prompt: str, n: int, params: dict) -> None:
        if self.ns.enable_log_requests:
            log("INFO", "logger.py:49", f"Received request {rid}: params: SamplingParams(temperature={params.get('temperature')}, max_tokens={params.get('max_tokens')}), num_prompt_tokens: {n}, lora_request: None.")
            log("DEBUG", "logger.py:67", f"Request {rid} details: prompt: {prompt!r}, prompt_token_ids: None, prompt_embeds shape: None.")

    def log_outputs(self, rid: str, text: str, finish: str, streaming: str = "") -> None:
        if self.ns.enable_log_outputs:
            log("INFO", "logger.py:86", f"Generated response {rid}{streaming}: output: {text!r}, output_token_ids: None, finish_reason: {finish}")

    def r_completions(self) -> None:
        body = self.read_json()
        self.check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        top_n = body.get("logprobs")
        if top_n is not None and not (isinstance(top_n, int) and 0 <= top_n <= 20):
            raise ApiError(400, "logprobs must be an integer in [0, 20]", param="logprobs")
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))
        self.log_inputs(rid, prompt, len(tokenize(prompt)), body)
        kv = self.engine.kv_handoff(body, rid, len(tokenize(prompt)))
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": body.get("model") or self.engine.model_name}
        if stream:
            self.start_stream()

            def emit(i, tok):
                self.sse({**base, "choices": [{"index": 0, "text": tok, "logprobs": None, "finish_reason": None}]})
        else:
            emit = lambda i, tok: None
        res = self.engine.generate(prompt, prompt, body, emit)
        toks = res["tokens"]
        text = "".join(toks)
        if body.get("echo"):
            text = prompt + text
        lp = None
        if top_n is not None:
            entries = logprob_entries(prompt, toks, top_n, self._jitter())
            offs, pos = [], len(prompt) if body.get("echo") else 0
            for tok in toks:
                offs.append(pos)
                pos += len(tok)
            lp = {"text_offset": offs, "token_logprobs": [e[1] for e in entries], "tokens": [e[0] for e in entries],
                  "top_logprobs": [{a: b for a, b in e[2]} for e in entries]}
        usage = {"prompt_tokens": res["n_prompt"], "total_tokens": res["n_prompt"] + len(toks),
                 "completion_tokens": len(toks), "prompt_tokens_details": {"cached_tokens": res["cached"]}}
        self.log_outputs(rid, text, res["finish_reason"], " (streaming complete)" if stream else "")
        if stream:
            self.sse({**base, "choices": [{"index": 0, "text": "", "logprobs": lp, "finish_reason": res["finish_reason"]}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                self.sse({**base, "choices": [], "usage": usage})
            self.sse("[DONE]")
            return
        self.send_json(200, {**base, "choices": [{"index": 0, "text": text, "logprobs": lp,
                                                  "finish_reason": res["finish_reason"], "stop_reason": None}],
                             "usage": usage, "kv_transfer_params": kv})

    def _jitter(self) -> float:
        return random.uniform(1e-4, 1e-3) if "nondeterministic" in self.engine.faults else 0.0

    def r_chat(self) -> None:
        body = self.read_json()
        self.check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        effort = body.get("reasoning_effort") or (body.get("chat_template_kwargs") or {}).get("reasoning_effort")
        check_effort(self.engine, effort)
        tools = body.get("tools") or None
        prompt = render_chatml(messages, tools)
        last = messages[-1]
        tail = content_text(last.get("content"))
        if "max_completion_tokens" in body and body.get("max_tokens") is None:
            body["max_tokens"] = body["max_completion_tokens"]
        tool = pick_tool(self.engine, tools, body.get("tool_choice"), last.get("role"))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))
        self.log_inputs(rid, prompt, len(tokenize(prompt)), body)
        kv = self.engine.kv_handoff(body, rid, len(tokenize(prompt)))
        thinking = bool(self.ns.reasoning_parser) and "/no_think" not in prompt and tool is None
        base = {"id": rid, "object": "chat.completion.chunk" if stream else "chat.completion",
                "created": int(time.time()), "model": body.get("model") or self.engine.model_name}
        if stream:
            self.start_stream()
            self.sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})

            def emit(i, tok):
                if tool is None:
                    self.sse({**base, "choices": [{"index": 0, "delta": {"content": tok}, "logprobs": None, "finish_reason": None}]})
        else:
            emit = lambda i, tok: None
        forced = None
        if last.get("role") == "tool":
            try:
                facts = json.loads(content_text(last.get("content")))
                said = ", ".join(f"{k} {v}" for k, v in facts.items()) if isinstance(facts, dict) else str(facts)
            except ValueError:
                said = content_text(last.get("content"))
            forced = tokenize(f"The tool reports {said}.")
        if tool is not None:
            fn = tool.get("function") or tool
            call_args = tool_arguments(tool, tail)
            forced = tokenize("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": call_args}) + "\n</tool_call>")
        res = self.engine.generate(prompt, tail, body, emit, forced)
        toks = res["tokens"]
        text = "".join(toks)
        message: dict = {"role": "assistant", "content": text, "tool_calls": []}
        finish = res["finish_reason"]
        if thinking:
            message["reasoning_content"] = "The user asks a question; answer it directly."
        if tool is not None:
            call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": fn.get("name"), "arguments": json.dumps(call_args)}}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish = "tool_calls"
        lp = None
        if body.get("logprobs"):
            top_n = int(body.get("top_logprobs") or 0)
            if not 0 <= top_n <= 20:
                raise ApiError(400, "top_logprobs must be in [0, 20]", param="top_logprobs")
            lp = {"content": [{"token": e[0], "logprob": e[1], "bytes": list(e[0].encode()),
                               "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in e[2]]}
                              for e in logprob_entries(prompt, toks, top_n, self._jitter())]}
        usage = {"prompt_tokens": res["n_prompt"], "total_tokens": res["n_prompt"] + len(toks),
                 "completion_tokens": len(toks), "prompt_tokens_details": {"cached_tokens": res["cached"]}}
        self.log_outputs(rid, text if tool is None else json.dumps(message["tool_calls"]), finish,
                        " (streaming complete)" if stream else "")
        if stream:
            if tool is not None:
                self.sse({**base, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}, "logprobs": None, "finish_reason": None}]})
            self.sse({**base, "choices": [{"index": 0, "delta": {}, "logprobs": lp, "finish_reason": finish}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                self.sse({**base, "choices": [], "usage": usage})
            self.sse("[DONE]")
            return
        self.send_json(200, {**base, "choices": [{"index": 0, "message": message, "logprobs": lp,
                                                  "finish_reason": finish, "stop_reason": None}], "usage": usage,
                             "kv_transfer_params": kv})

    def r_messages(self) -> None:
        """Anthropic Messages API, as vLLM serves it (Claude Code talks to this)."""
        body = self.read_json()
        self.check_model(body)
        if not isinstance(body.get("max_tokens"), int):
            raise ApiError(400, "max_tokens: Field required", param="max_tokens")
        effort = (body.get("output_config") or {}).get("effort")
        check_effort(self.engine, effort)
        msgs = []
        if body.get("system"):
            msgs.append({"role": "system", "content": content_text(body["system"])})
        for m in body.get("messages") or []:
            msgs.append({"role": m.get("role"), "content": content_text(m.get("content"))})
        if len(msgs) == (1 if body.get("system") else 0):
            raise ApiError(400, "messages: at least one message is required", param="messages")
        tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                   "parameters": t.get("input_schema") or {}}} for t in body.get("tools") or []]
        prompt = render_chatml(msgs, tools or None)
        tail = msgs[-1]["content"]
        rid = f"msg_{uuid.uuid4().hex[:24]}"
        self.log_inputs(rid, prompt, len(tokenize(prompt)), body)
        kv = self.engine.kv_handoff(body, rid, len(tokenize(prompt)))
        tool = pick_tool(self.engine, tools, body.get("tool_choice"), msgs[-1]["role"])
        forced = None
        if tool is not None:
            forced = tokenize("<tool_call>\n" + json.dumps({"name": tool["function"]["name"], "arguments": tool_arguments(tool, tail)}) + "\n</tool_call>")
        model = body.get("model") or self.engine.model_name
        stream = bool(body.get("stream"))
        emit = lambda i, t: None
        if stream:  # Anthropic's event stream (Claude Code always streams)
            self.start_stream()
            self.sse({"type": "message_start", "message": {"id": rid, "type": "message", "role": "assistant", "model": model,
                      "content": [], "stop_reason": None, "stop_sequence": None,
                      "usage": {"input_tokens": len(tokenize(prompt)), "output_tokens": 0}}}, event="message_start")
            if tool is None:
                self.sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                         event="content_block_start")
                emit = lambda i, t: self.sse({"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": t}}, event="content_block_delta")
        res = self.engine.generate(prompt, tail, {"max_tokens": body["max_tokens"], "temperature": body.get("temperature"),
                                                  "stop": body.get("stop_sequences")}, emit, forced)
        text = "".join(res["tokens"])
        content = [{"type": "text", "text": text}]
        stop = "end_turn" if res["finish_reason"] == "stop" else "max_tokens"
        if tool is not None:
            fn = tool["function"]
            content = [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": fn["name"],
                        "input": tool_arguments(tool, tail)}]
            stop = "tool_use"
        self.log_outputs(rid, text, res["finish_reason"], " (streaming complete)" if stream else "")
        if stream:
            if tool is not None:
                block = content[0]
                self.sse({"type": "content_block_start", "index": 0, "content_block": {**block, "input": {}}},
                         event="content_block_start")
                self.sse({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta",
                          "partial_json": json.dumps(block["input"])}}, event="content_block_delta")
            self.sse({"type": "content_block_stop", "index": 0}, event="content_block_stop")
            self.sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                      "usage": {"output_tokens": len(res["tokens"])}}, event="message_delta")
            self.sse({"type": "message_stop"}, event="message_stop")
            return
        self.send_json(200, {"id": rid, "type": "message", "role": "assistant", "model": model,
                             "content": content, "stop_reason": stop, "stop_sequence": None,
                             "usage": {"input_tokens": res["n_prompt"], "output_tokens": len(res["tokens"]),
                                       "cache_read_input_tokens": res["cached"]}, "kv_transfer_params": kv})


# ---------------------------------------------------------------------------------------------
# multi-node ranks: the stand-in checks the rank argv it was given (what vLLM's create_engine_config
# and run_headless would refuse) and meets its peers over real TCP on the head's rendezvous port,
# so a rank that dies takes the deployment down the way vLLM's executor does.
class RankError(Exception):
    pass


def rank_plan(ns: argparse.Namespace) -> dict | None:
    """None on one box; else {"rank", "world", "addr", "port", "kind"} after vLLM's own checks."""
    if ns.nnodes > 1:
        world = ns.tensor_parallel_size * ns.pipeline_parallel_size * ns.data_parallel_size
        if world % ns.nnodes:
            raise RankError(f"`--nnodes {ns.nnodes}` must evenly divide the total world size ({world})")
        if not 0 <= ns.node_rank < ns.nnodes:
            raise RankError(f"`--node-rank` must be between 0 and {ns.nnodes - 1}; got `--node-rank {ns.node_rank}`")
        if ns.headless != (ns.node_rank > 0):
            raise RankError("--headless belongs on every rank but the head (node rank 0): "
                            f"got --node-rank {ns.node_rank} {'with' if ns.headless else 'without'} --headless")
        return {"rank": ns.node_rank, "world": ns.nnodes, "addr": ns.master_addr, "port": ns.master_port, "kind": "tp"}
    if ns.data_parallel_size > 1:
        local = ns.data_parallel_size_local if ns.data_parallel_size_local is not None else ns.data_parallel_size
        if local == ns.data_parallel_size:
            return None  # every DP rank in this one process tree
        if not ns.data_parallel_address:
            raise RankError("a data-parallel deployment across nodes needs --data-parallel-address")
        start = ns.data_parallel_start_rank or 0
        if ns.headless != (start > 0):
            raise RankError(f"--headless belongs on the ranks that start above 0: got --data-parallel-start-rank {start} "
                            f"{'with' if ns.headless else 'without'} --headless")
        return {"rank": start, "world": ns.data_parallel_size // local, "addr": ns.data_parallel_address,
                "port": ns.data_parallel_rpc_port, "kind": "dp"}
    if ns.headless:
        raise RankError("--headless without a multi-node launch (--nnodes > 1 or a data-parallel start rank)")
    return None


def rendezvous(plan: dict, env: dict) -> None:
    """Head: listen on addr:port until every other rank has joined, then watch them (a lost rank
    is fatal). Worker: join the head (retry until STANDIN_RENDEZVOUS_TIMEOUT), then stay headless
    until the head goes away."""
    import socket

    timeout = float(env.get("STANDIN_RENDEZVOUS_TIMEOUT", "120"))
    where = f"{plan['addr']}:{plan['port']}"
    if plan["rank"] == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((plan["addr"], plan["port"]))
        srv.listen(8)
        srv.settimeout(timeout)
        log("INFO", "parallel_state.py:1203", f"rank 0 waiting for {plan['world'] - 1} rank(s) on {where} ({plan['kind']})")
        peers = []
        try:
            while len(peers) < plan["world"] - 1:
                conn, _ = srv.accept()
                rank = conn.recv(64).decode().strip()
                log("INFO", "parallel_state.py:1210", f"rank {rank} joined from its node")
                peers.append((rank, conn))
        except socket.timeout:
            log("ERROR", "multiproc_executor.py:140", f"timed out waiting for the other ranks on {where}")
            sys.exit(1)

        def watch(rank: str, conn) -> None:
            conn.settimeout(None)
            try:
                conn.recv(1)
            except OSError:
                pass
            log("ERROR", "multiproc_executor.py:301", f"Worker proc rank {rank} died unexpectedly, shutting down executor.")
            os._exit(1)

        for rank, conn in peers:
            threading.Thread(target=watch, args=(rank, conn), daemon=True).start()
        log("INFO", "pynccl.py:77", "NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0> (stand-in: no RDMA)")
        return
    deadline = time.monotonic() + timeout
    log("INFO", "serve.py:226", f"Launching vLLM headless rank {plan['rank']} ({plan['kind']}), head node address {where}")
    while True:
        try:
            conn = socket.create_connection((plan["addr"], plan["port"]), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                log("ERROR", "serve.py:240", f"could not reach the head node at {where}")
                sys.exit(1)
            time.sleep(0.3)
    conn.sendall(f"{plan['rank']}\n".encode())
    log("INFO", "pynccl.py:77", "NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0> (stand-in: no RDMA)")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    conn.settimeout(None)
    try:
        conn.recv(1)
    except OSError:
        pass
    log("ERROR", "multiproc_executor.py:301", "the head node went away; headless rank exiting")
    sys.exit(1)


def boot(ns: argparse.Namespace, env: dict) -> None:
    """What vLLM prints while it loads; nothing listens yet."""
    seconds = float(env.get("STANDIN_BOOT_SECONDS", "1"))
    log("INFO", "api_server.py:1885", f"vLLM API server version {VERSION}")
    log("INFO", "utils.py:326", f"non-default args: {{'model': {ns.model!r}, 'host': {ns.host!r}, 'port': {ns.port}}}")
    if os.path.isabs(ns.model) and not os.path.exists(ns.model) and env.get("STANDIN_SKIP_MODEL_CHECK") != "1":
        log("ERROR", "api_server.py:1900", f"OSError: Incorrect path_or_model_id: '{ns.model}'. Please provide either the path to a local folder or the repo_id of a model on the Hub.")
        sys.exit(1)
    log("INFO", "model.py:547", f"Resolved architecture: Qwen3_8FlashNextForCausalLM")
    if getattr(ns, "yarn_requested", None):
        log("INFO", "model.py:1510", f"Using max model len {ns.yarn_requested}")
    log("INFO", "model.py:1510", f"Using max model len {ns.max_model_len or 262144}")
    die = env.get("STANDIN_DIE_AT_BOOT")
    steps = ("Loading safetensors checkpoint shards:   0% Completed | 0/23 [00:00<?, ?it/s]",
             "Loading safetensors checkpoint shards: 100% Completed | 23/23 [00:00<00:00]")
    for i, line in enumerate(steps):
        print(line, flush=True)
        time.sleep(seconds / 3)
        if die is not None and i == 0:
            log("ERROR", "core.py:708", "EngineCore failed to start.")
            print("Traceback (most recent call last):\n  File \"/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py\", "
                  "line 699, in run_engine_core\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
                  "(stand-in: STANDIN_DIE_AT_BOOT)", flush=True)
            log("ERROR", "api_server.py:1900", "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")
            sys.exit(int(die))
    log("INFO", "default_loader.py:268", f"Loading weights took {seconds / 3:.2f} seconds")
    if env.get("VLLM_PLE_MMAP") == "1":
        # the real line's shape (H200 run40, _ple_guard.py), which the gpu-e2e fleet's ple_memory reads
        log("INFO", "_ple_guard.py:55", "flash_vllm patch 1: PLE mmap: 128 shards, 320001536 rows x 160 B (47.68 GiB on "
            "disk), dtype F8_E4M3, scale 0.0001, io uring, madvise %s" % env.get("VLLM_PLE_MMAP_MADVISE", "random"))
    kv = int(env.get("STANDIN_KV_TOKENS", "1234567"))
    log("INFO", "kv_cache_utils.py:1087", f"GPU KV cache size: {kv:,} tokens")
    mml = ns.max_model_len or 262144
    log("INFO", "kv_cache_utils.py:1091", f"Maximum concurrency for {mml:,} tokens per request: {kv / mml:.2f}x")
    time.sleep(float(env.get("STANDIN_KV_ALLOC_SECONDS", "0")))
    time.sleep(seconds / 3)
    log("INFO", "core.py:210", f"init engine (profile, create kv cache, warmup model) took {seconds:.2f} seconds")


def main(argv: list[str]) -> int:
    ns, unknown = parse_argv(argv)
    env = dict(os.environ)
    try:
        plan = rank_plan(ns)
    except RankError as exc:
        log("ERROR", "arg_utils.py:2390", f"ValueError: Invalid data-parallel launch options: {exc}")
        return 2
    if plan is not None and plan["rank"] > 0:  # headless: no API, lives as long as the head
        log("INFO", "api_server.py:1885", f"vLLM API server version {VERSION} (headless)")
        time.sleep(float(env.get("STANDIN_BOOT_SECONDS", "1")) / 3)
        rendezvous(plan, env)
        return 1
    if plan is not None:
        rendezvous(plan, env)
    if "yarn_ignored" in env.get("STANDIN_FAULTS", "") and (ns.max_model_len or 0) > 262144:
        ns.yarn_requested, ns.max_model_len = ns.max_model_len, 262144
    engine = Engine(ns, env)
    boot(ns, env)
    Handler.rank_plan = plan
    Handler.engine, Handler.argv, Handler.ns, Handler.unknown = engine, list(argv), ns, unknown
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.allow_reuse_address = True
    httpd = ThreadingHTTPServer((ns.host, ns.port), Handler)
    log("INFO", "api_server.py:1971", f"Starting vLLM API server 0 on http://{ns.host}:{httpd.server_port}")
    log("INFO", "launcher.py:37", "Available routes are: /health, /metrics, /v1/models, /v1/chat/completions, /v1/completions, /v1/messages, /tokenize")
    print(f"INFO:     Started server process [{os.getpid()}]", flush=True)
    print("INFO:     Waiting for application startup.", flush=True)
    print("INFO:     Application startup complete.", flush=True)
    threading.Thread(target=engine.stats_loop, args=(float(env.get("STANDIN_STATS_SEC", "10")),), daemon=True).start()

    def on_term(signum, _frame):
        print("INFO:     Shutting down", flush=True)
        engine.stopping = True
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    httpd.serve_forever(poll_interval=0.1)
    httpd.server_close()
    deadline = time.monotonic() + 10
    with engine.cond:
        while (engine.running or engine.waiting) and time.monotonic() < deadline:
            engine.cond.wait(0.05)
    time.sleep(0.05)  # let the last responses flush
    print("INFO:     Waiting for application shutdown.", flush=True)
    print("INFO:     Application shutdown complete.", flush=True)
    print(f"INFO:     Finished server process [{os.getpid()}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
