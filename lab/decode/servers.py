"""The servers the decode bench compares (stock, eager, hoisted, opt-in variants) as env + argv,
and their lifecycle: wait for /health, stop a process group (TERM, then KILL after 60 s)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path


CONFIGS = ("stock", "eager", "hoisted")


# opt-in variants (`--configs`): hoisted with the Stager's dedup threshold of run6 (256), where
# c=8 x MTP=2 = 384 rows took the dedup side; the default (1025) keeps every decode batch up to the
# Stager's graph limit (1,024 rows) on the short path
VARIANTS = {"hoisted-dedup256": ("hoisted", {"VLLM_PLE_MMAP_DEDUP_MIN": "256"})}

ALL_CONFIGS = CONFIGS + tuple(VARIANTS)


def server_plan(d: Path, port: int, side_by_side: bool = False) -> dict:
    """The three servers and the opt-in VARIANTS: env + argv. Common: dummy weights, MTP=2, 8
    sequences, short context. side_by_side: ports port, port+1, ... (CONFIGS then VARIANTS) and a
    fixed 4 GiB KV pool each (no memory profiling, so boots at once cannot starve each other), for
    `matrix`; else one at a time at 0.95."""
    mem = ["--gpu-memory-utilization", "0.30", "--kv-cache-memory-bytes", str(4 << 30)] if side_by_side else \
        ["--gpu-memory-utilization", "0.95"]

    def common(i: int) -> list[str]:
        return ["vllm", "serve", str(d / "model"), "--load-format", "dummy", "--served-model-name", "bench",
                "--port", str(port + i if side_by_side else port), "--max-model-len", "4096", "--max-num-seqs", "8",
                *mem, "--block-size", "256", "--no-enable-prefix-caching",
                "--language-model-only",  # no vision tower, no image profiling: decode is text only
                "--max-num-batched-tokens", "2048",
                "--gdn-prefill-backend", "triton",
                "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2}, separators=(",", ":"))]
    base_env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    ple_env = {**base_env, "VLLM_PLE_MMAP": "1", "VLLM_PLE_MMAP_DIR": str(d / "ple")}

    def cc(mode):
        # decode batches here are <= 8 requests x 3 tokens: capture up to 32 tokens (a shorter boot)
        return ["--compilation-config", json.dumps({"cudagraph_mode": mode, "max_cudagraph_capture_size": 32},
                                                   separators=(",", ":"))]

    plans = {
        # the ceiling: the release's own storage with the whole table on the GPU, vLLM's default graphs
        # (patch 1 off explicitly: the plugin is installed in all three; the other patches are alike)
        "stock": {"env": {**base_env, "VLLM_PLE_MMAP": "0"},
                  "argv": common(0) + ["--engram-config", '{"cpu_offload":false}'] + cc("FULL_AND_PIECEWISE")},
        "eager": {"env": {**ple_env, "VLLM_PLE_MMAP_MODE": "eager"}, "argv": common(1) + cc("PIECEWISE")},
        "hoisted": {"env": {**ple_env, "VLLM_PLE_MMAP_MODE": "hoisted"}, "argv": common(2) + cc("FULL_AND_PIECEWISE")},
    }
    # a variant: its base's server with more env, on the next port
    head = len(common(0))
    return plans | {name: {"env": {**plans[base]["env"], **env}, "argv": common(len(plans) + i) + plans[base]["argv"][head:]}
                    for i, (name, (base, env)) in enumerate(VARIANTS.items())}


def plan_cmd(args) -> int:
    print(json.dumps(server_plan(Path(args.dir).resolve(), args.port), indent=1))
    return 0


def wait_health(url: str, proc, timeout: float) -> None:
    import requests

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited with {proc.returncode} before /health")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise SystemExit(f"no /health after {timeout:.0f} s")


def stop_all(procs: dict) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    end = time.monotonic() + 60
    for proc in procs.values():
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def parse_configs(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in ALL_CONFIGS]
    if bad or not names or len(set(names)) < len(names):
        raise SystemExit(f"--configs {text!r}: give a comma-separated subset of {', '.join(ALL_CONFIGS)}, each once")
    return names
