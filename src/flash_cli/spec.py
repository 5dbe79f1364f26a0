"""PURE: resolved settings → RunSpec (everything `docker run` needs, as plain data).

`serve`, `serve --dry-run`, `scripts/serve.sh` and the golden tests all go through `build()`;
render.py turns the result into docker-py kwargs or an equivalent `docker run` line. Nothing
here touches Docker, the network or the file system (inputs arrive as arguments).
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field

# Claude Code sends high/max/minimal; the template knows xhigh/medium/low only. One map, shared
# with patch 12 (which applies it on v0.29-v0.32), so the two cannot drift.
from flash_vllm.effort import EFFORT_MAP

from . import __version__
from .hfcache import VARIANT_SUFFIX
from .errors import ConfigError
from .settings import Settings, split_args

CONTAINER_PORT = 8000
HF_MOUNT = "/hf"
KEY_TARGET = "/run/flash/api_key"
LOGGING_TARGET = "/etc/flash/logging.json"
PROM_DIR = "/tmp/vllm-prometheus"
SECRET_ENV = ("VLLM_API_KEY", "FLASH_API_KEY_FILE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
LABEL = "org.flash"  # every label key starts with this; `org.flash.name` finds the container

# YaRN ×4 over the native 262,144 positions (values from the model card's long-context recipe).
YARN_ROPE = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "rope_type": "yarn",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "factor": 4.0,
    "original_max_position_embeddings": 262144,
}
NATIVE_CTX = 262144
COMPILE_CACHE_TARGETS = {"vllm": "/root/.cache/vllm", "flashinfer": "/root/.cache/flashinfer",
                         "triton": "/root/.triton"}


@dataclass(frozen=True)
class Mount:
    kind: str  # bind | volume | tmpfs
    target: str
    source: str = ""
    read_only: bool = False
    options: str = ""  # tmpfs options, e.g. "size=256m"


@dataclass(frozen=True)
class RunSpec:
    name: str
    image: str
    entrypoint: list[str]
    command: list[str]
    env: dict[str, str]
    labels: dict[str, str]
    mounts: list[Mount]
    network: str  # bridge | host
    ports: dict[str, tuple[str, int]]  # "8000/tcp" -> (bind, host port); empty on host network
    restart: str
    gpus: bool
    ipc: str
    shm_size: int
    log_max_size: str
    log_max_files: int
    cpuset: str | None
    healthcheck: dict
    api_url: str
    warnings: list[str] = field(default_factory=list)
    needs_api_key: bool = False
    key_file: str = ""  # host path of the key file (mounted read-only), when needed


def default_image(base: str) -> str:
    return f"flash-vllm:{base}"


def is_loopback(bind: str) -> bool:
    return ipaddress.ip_address(bind).is_loopback


def model_path(model: str, snapshot: str, mode: str) -> str:
    org_name = model.replace("/", "--")
    return f"{HF_MOUNT}/hub/models--{org_name}/snapshots/{snapshot}{VARIANT_SUFFIX[mode]}"


def ple_hoisted(s: Settings) -> bool:
    """PLE_MODE=hoisted on a base whose runner patch 1 hooks (the plugin's registry says which)."""
    from flash_vllm.patches import ple_hoist  # metadata only: no vLLM, no torch

    return s["PLE_MODE"] == "hoisted" and ple_hoist.serves(s["BASE"])


def compilation_args(s: Settings) -> list[str]:
    """Graph regime per base. Patch 1's eager mode gathers the PLE rows on the host inside the
    forward, which a FULL decode graph would capture as a constant: PIECEWISE (vllm-releases.md
    §3). Its hoisted mode (PLE_MODE=hoisted, where served) gathers before the forward, so vLLM's
    FULL_AND_PIECEWISE applies. On 0.29 the plugin appends its lookup op to vLLM's splitting ops
    itself, so no list is needed here."""
    if s["COMPILE_FLAGS"]:
        return split_args(s["COMPILE_FLAGS"], "COMPILE_FLAGS")
    mode = "FULL_AND_PIECEWISE" if ple_hoisted(s) else "PIECEWISE"
    return ["--compilation-config", json.dumps({"cudagraph_mode": mode}, separators=(",", ":"))]


def vllm_args(s: Settings, snapshot: str, host: str, port: int) -> list[str]:
    ctx, yarn, mtp, base = s["CTX"], s["YARN"], s["MTP"], s["BASE"]
    argv = [
        "vllm", "serve", model_path(s["MODEL"], snapshot, s["MODE"]),
        "--served-model-name", s["SERVED_MODEL_NAME"],
        "--host", host, "--port", str(port),
        "--load-format", "safetensors",
        "--max-model-len", str(ctx),
        "--max-num-seqs", str(s["SEQS"]),
        "--gpu-memory-utilization", f"{s['GPU_MEM']:.2f}",
        "--enable-prefix-caching" if s["PREFIX_CACHE"] else "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--max-num-batched-tokens", str(s["BATCHED_TOKENS"]),
        *compilation_args(s),
        "--kv-cache-dtype", s["KV_DTYPE"],
    ]
    if s["KV_CACHE_MEM"] is not None:
        argv += ["--kv-cache-memory-bytes", str(s["KV_CACHE_MEM"])]
    if yarn:
        overrides = {"text_config": {"rope_parameters": YARN_ROPE}}
        argv += ["--hf-overrides", json.dumps(overrides, separators=(",", ":"))]
    if s["LOG_REQUESTS"]:
        argv += ["--enable-log-requests", "--enable-log-outputs"]
    argv += ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3",
             "--enable-prompt-tokens-details"]
    if s["EFFORT_ALIAS"] and base == "v0.33":
        argv += ["--reasoning-effort-map", json.dumps(EFFORT_MAP, separators=(",", ":"))]
    if mtp:
        spec: dict = {"method": "mtp", "num_speculative_tokens": mtp}
        if yarn:  # dict hf_overrides do not reach the draft model: give it the length itself
            spec["max_model_len"] = ctx
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    # EXTRA last: argparse keeps the last occurrence, so a user flag wins over ours.
    return argv + split_args(s["EXTRA"], "EXTRA")


def container_env(s: Settings, needs_key: bool) -> dict[str, str]:
    from .settings import SETTINGS

    env = {
        "HF_HOME": HF_MOUNT,
        "HF_HUB_OFFLINE": "1",
        "VLLM_PLE_MMAP": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "1",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1" if s["YARN"] else "0",
    }
    for setting in SETTINGS:  # the table's direct env mappings (MADVISE, WORKERS, ...)
        if setting.env:
            env[setting.env] = setting.format(s[setting.name])
    vocab = s["DRAFT_VOCAB"]
    if vocab != "0" and s["MTP"]:
        env["VLLM_MTP_DRAFT_VOCAB"] = "default" if vocab == "1" else vocab
    if s["MODE"] in ("hybrid", "hybrid-mtp"):
        env["VLLM_FP8_HYBRID"] = "1"
        env["VLLM_USE_DEEP_GEMM"] = "0"
    if s["EFFORT_ALIAS"] and s["BASE"] != "v0.33":
        env["FLASH_EFFORT_ALIAS"] = "1"
    if s["PROM_MULTIPROC"]:
        env["PROMETHEUS_MULTIPROC_DIR"] = PROM_DIR
    if s["LOG_REQUESTS"]:
        env["VLLM_LOGGING_CONFIG_PATH"] = LOGGING_TARGET
    if needs_key:
        env["FLASH_API_KEY_FILE"] = KEY_TARGET  # the path, never the key
    env.update(extra_env(s["CONTAINER_ENV"]))
    return dict(sorted(env.items()))


def extra_env(text: str | None) -> dict[str, str]:
    out = {}
    for word in split_args(text, "CONTAINER_ENV"):
        key, sep, value = word.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"CONTAINER_ENV word {word!r} is not KEY=VALUE",
                              hint="CONTAINER_ENV accepts space-separated KEY=VALUE words, e.g. 'NCCL_DEBUG=INFO'")
        if key in SECRET_ENV:
            raise ConfigError(f"CONTAINER_ENV must not carry {key}: it would show in docker inspect",
                              hint="use API_KEY=on (the key file stays out of docker inspect)")
        out[key] = value
    return out


def compile_cache_mounts(value: str | None) -> list[Mount]:
    if not value:
        return []
    if value.startswith("/"):
        return [Mount("bind", t, f"{value}/{sub}") for sub, t in COMPILE_CACHE_TARGETS.items()]
    return [Mount("volume", t, f"{value}-{sub}") for sub, t in COMPILE_CACHE_TARGETS.items()]


def needs_api_key(s: Settings) -> bool:
    mode = s["API_KEY"]
    return mode == "on" or (mode == "auto" and not is_loopback(s["BIND"]))


def build(
    s: Settings,
    *,
    profile: str,
    snapshot: str,
    hf_cache: str,
    state_dir: str,
) -> RunSpec:
    """Settings + host facts (resolved snapshot name, absolute HF cache and state paths)."""
    name, base, bind, port = s["NAME"], s["BASE"], s["BIND"], s["PORT"]
    image = s["IMAGE"] or default_image(base)
    network = s["NETWORK"]
    warnings: list[str] = []
    if network == "host":
        host, listen_port, ports = bind, port, {}
    else:
        host, listen_port = "0.0.0.0", CONTAINER_PORT
        ports = {f"{CONTAINER_PORT}/tcp": (bind, port)}
    key = needs_api_key(s)
    if not is_loopback(bind) and s["API_KEY"] == "off":
        warnings.append(f"API published on {bind}:{port} WITHOUT an API key (API_KEY=off): anyone who can "
                        "reach this port can use the model")
    if s["PAD_M4"]:
        warnings.append("PAD_M4 has no effect: M%4 padding is upstream in every supported vLLM release")
    if s["CTX"] > NATIVE_CTX and not s["YARN"]:
        warnings.append(f"CTX={s['CTX']} is above the native {NATIVE_CTX} without YARN=1: vLLM will refuse it")

    mounts = [Mount("bind", HF_MOUNT, hf_cache, read_only=True)]
    key_file = f"{state_dir}/api-key.{name}" if key else ""
    if key:
        mounts.append(Mount("bind", KEY_TARGET, key_file, read_only=True))
    if s["LOG_REQUESTS"]:
        mounts.append(Mount("bind", LOGGING_TARGET, f"{state_dir}/logging.json", read_only=True))
    if s["PROM_MULTIPROC"]:
        mounts.append(Mount("tmpfs", PROM_DIR, options="size=256m"))
    mounts += compile_cache_mounts(s["COMPILE_CACHE"])

    labels = {
        f"{LABEL}.name": name,
        f"{LABEL}.profile": profile,
        f"{LABEL}.base": base,
        f"{LABEL}.image": image,
        f"{LABEL}.port": str(port),
        f"{LABEL}.bind": bind,
        f"{LABEL}.mode": s["MODE"],
        f"{LABEL}.model": s["MODEL"],
        f"{LABEL}.served-model-name": s["SERVED_MODEL_NAME"],
        f"{LABEL}.settings": s.digest(),
        f"{LABEL}.recipe": json.dumps(s.overrides(), separators=(",", ":"), sort_keys=True),
        f"{LABEL}.api-key": "required" if key else "none",
        f"{LABEL}.version": __version__,
    }
    url_host = "127.0.0.1" if bind in ("0.0.0.0", "::") or is_loopback(bind) else bind
    return RunSpec(
        name=name,
        image=image,
        entrypoint=["python3", "-m", "flash_vllm.launch"],
        command=vllm_args(s, snapshot, host, listen_port),
        env=container_env(s, key),
        labels=labels,
        mounts=mounts,
        network=network,
        ports=ports,
        restart=s["RESTART"],
        gpus=s["GPUS"] == "all",
        ipc="host",
        shm_size=s["SHM_SIZE"],
        log_max_size=s["LOG_MAX_SIZE"],
        log_max_files=s["LOG_MAX_FILES"],
        cpuset=s["CPUSET"],
        # Boots take 8-13 minutes: a generous start period, then a cheap /health probe.
        healthcheck={"test": ["CMD", "python3", "-m", "flash_vllm.launch", "--health", str(listen_port)], "interval": 30 * 10**9,
                     "timeout": 10 * 10**9, "retries": 3, "start_period": 1800 * 10**9},
        api_url=f"http://{url_host}:{port}",
        warnings=warnings,
        needs_api_key=key,
        key_file=key_file,
    )
