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
# with patch 12 (which applies it where vLLM has no --reasoning-effort-map), so the two cannot drift.
from flash_common import releases
from flash_common.effort import EFFORT_MAP

from . import __version__, layout
from .checkpoint import known
from .hfcache import VARIANT_SUFFIX
from .errors import ConfigError
from .exposure import open_api
from .settings import Settings, split_args

# The server's default reasoning effort reaches the chat template this way on every base (the
# servings merge it under the request's own kwargs: a request that sets reasoning_effort wins).
DEFAULT_CHAT_TEMPLATE_KWARGS = "--default-chat-template-kwargs"

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
    propagation: str = ""  # bind propagation, e.g. "rslave" (node-exporter's view of the host's mounts)


@dataclass(frozen=True)
class RunSpec:
    """One container. The server's (build()) fills every field; a helper container (monitor.py)
    leaves entrypoint, ipc, shm_size and healthcheck empty: the image's own apply."""

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
    # multi-node boxes only (multinode.py): RDMA devices and limits, the GPUs of this rank
    devices: list[str] = field(default_factory=list)  # host paths passed through (same path inside)
    cap_add: list[str] = field(default_factory=list)
    ulimits: list[tuple[str, int, int]] = field(default_factory=list)  # (name, soft, hard)
    gpu_ids: list[str] = field(default_factory=list)  # empty: every GPU (when gpus)
    pid_mode: str = ""  # "host": the container sees the host's processes (node-exporter)
    user: str = ""  # uid[:gid] inside the container; empty: the image's


def default_image(base: str) -> str:
    return f"flash-vllm:{base}"


def is_loopback(bind: str) -> bool:
    return ipaddress.ip_address(bind).is_loopback


def model_path(model: str, snapshot: str, mode: str) -> str:
    org_name = model.replace("/", "--")
    return f"{HF_MOUNT}/hub/models--{org_name}/snapshots/{snapshot}{VARIANT_SUFFIX[mode]}"


def ple_mode(s: Settings) -> str:
    """Patch 1's gather mode for this base: PLE_MODE, with `auto` resolved to hoisted where the
    catalogue's `ple_hoisted` says the runner hook exists, eager elsewhere (an explicit `hoisted`
    on such a base is preflight's to refuse)."""
    mode = s["PLE_MODE"]
    if mode == "auto":
        return "hoisted" if releases.has(s["BASE"], "ple_hoisted") else "eager"
    return mode


def ple_hoisted(s: Settings) -> bool:
    """The hoisted gather, on a base whose runner patch 1 hooks."""
    return ple_mode(s) == "hoisted" and releases.has(s["BASE"], "ple_hoisted")


def ple_patch_off(s: Settings) -> bool:
    """Patch 1 turned off by the user's CONTAINER_ENV (VLLM_PLE_MMAP=0, or 1 in FLASH_DISABLE_PATCHES):
    the release's own PLE storage serves, and FULL graphs are vLLM's business again."""
    env = extra_env(s["CONTAINER_ENV"])
    disabled = {w.strip() for w in env.get("FLASH_DISABLE_PATCHES", "").split(",")}
    return env.get("VLLM_PLE_MMAP", "1").strip().lower() in ("0", "false", "no", "off") or "1" in disabled


def compilation_args(s: Settings) -> list[str]:
    """Graph regime per base. Patch 1's eager mode gathers the PLE rows on the host inside the
    forward, which a FULL decode graph would capture as a constant: PIECEWISE (vllm-releases.md
    §3). Its hoisted mode (PLE_MODE auto or hoisted, where served) gathers before the forward, so
    vLLM's FULL_AND_PIECEWISE applies. On 0.29 the plugin appends its lookup op to vLLM's splitting ops
    itself, so no list is needed here."""
    if s["COMPILE_FLAGS"]:
        if s["GRAPH_TOKENS"]:
            raise ConfigError(f"GRAPH_TOKENS={s['GRAPH_TOKENS']} is not applied when COMPILE_FLAGS replaces the "
                              "compilation flags", hint="put max_cudagraph_capture_size in COMPILE_FLAGS and set "
                              "GRAPH_TOKENS=0, or leave COMPILE_FLAGS empty")
        return split_args(s["COMPILE_FLAGS"], "COMPILE_FLAGS")
    cc: dict = {"cudagraph_mode": "FULL_AND_PIECEWISE" if ple_hoisted(s) else "PIECEWISE"}
    if s["GRAPH_TOKENS"]:
        cc["max_cudagraph_capture_size"] = s["GRAPH_TOKENS"]
    return ["--compilation-config", json.dumps(cc, separators=(",", ":"))]


def vllm_args(s: Settings, snapshot: str, host: str, port: int, parallel: list[str] = ()) -> list[str]:
    ctx, yarn, base = s["CTX"], s["YARN"], s["BASE"]
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
    argv += retention_args(s)
    argv += long_prefill_args(s)
    if yarn:
        overrides = {"text_config": {"rope_parameters": YARN_ROPE}}
        argv += ["--hf-overrides", json.dumps(overrides, separators=(",", ":"))]
    if s["LOG_REQUESTS"]:
        argv += ["--enable-log-requests", "--enable-log-outputs"]
    argv += ["--enable-auto-tool-choice", "--tool-call-parser", s["TOOL_PARSER"], "--reasoning-parser", "qwen3",
             "--enable-prompt-tokens-details"]
    if s["EFFORT_ALIAS"] and releases.has(base, "reasoning_effort_map"):
        argv += ["--reasoning-effort-map", json.dumps(EFFORT_MAP, separators=(",", ":"))]
    if s["EFFORT_DEFAULT"]:
        argv += [DEFAULT_CHAT_TEMPLATE_KWARGS,
                 json.dumps({"reasoning_effort": s["EFFORT_DEFAULT"]}, separators=(",", ":"))]
    spec = speculative_config(s)
    if spec:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    argv += list(parallel)  # this box's multi-node flags (multinode.py); none on one box
    # EXTRA last: argparse keeps the last occurrence, so a user flag wins over ours.
    return argv + split_args(s["EXTRA"], "EXTRA")


def retention_args(s: Settings) -> list[str]:
    """PREFIX_RETAIN=dense → vLLM's `None` (its optional-int parser's word for "every checkpoint").
    0 renders nothing: the release's own default, so the proven argv stays as it was."""
    if s["PREFIX_RETAIN"] == "0":
        return []
    if not s["PREFIX_CACHE"]:
        raise ConfigError(f"PREFIX_RETAIN={s['PREFIX_RETAIN']} needs PREFIX_CACHE=1 (it says which prefix-cache "
                          "states to keep; with PREFIX_CACHE=0 there is no cache)",
                          hint="set PREFIX_CACHE=1, or leave PREFIX_RETAIN=0")
    return ["--prefix-cache-retention-interval", "None"]


def long_prefill_args(s: Settings) -> list[str]:
    """LONG_PREFILL=N → `--long-prefill-token-threshold N`; 0 renders nothing (vLLM's default)."""
    n = s["LONG_PREFILL"]
    if not n:
        return []
    if n > s["CTX"]:  # vLLM's SchedulerConfig refuses it at start
        raise ConfigError(f"LONG_PREFILL={n} is above CTX={s['CTX']} (vLLM refuses a long-prefill threshold "
                          "above the context length)", hint=f"LONG_PREFILL accepts 0 (off) to {s['CTX']}")
    return ["--long-prefill-token-threshold", str(n)]


def mtp_schedule(s: Settings) -> list[list[int]] | None:
    """MTP_BY_BATCH `1:3,3:2,6:1` → vLLM's inclusive ranges [[1,2,3],[3,5,2],[6,SEQS,1]], checked the
    way vllm/v1/spec_decode/dynamic/utils.py checks them (first range at 1, no overlap)."""
    text = s["MTP_BY_BATCH"]
    if not text:
        return None
    where = f"MTP_BY_BATCH={text!r}"
    if not s["MTP"]:
        raise ConfigError(f"{where} needs MTP > 0 (MTP=0 turns speculative decoding off)",
                          hint="set MTP to the largest K in the schedule, or leave MTP_BY_BATCH empty")
    base = s["BASE"]
    if not releases.has(base, "spec_tokens_per_batch_size"):
        raise ConfigError(f"{where}: BASE={base}'s vLLM has no num_speculative_tokens_per_batch_size",
                          hint=f"bases that accept it: {', '.join(sorted(releases.where('spec_tokens_per_batch_size', True)))}")
    pairs = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    starts = [b for b, _ in pairs]
    if starts[0] != 1 or any(b2 <= b1 for b1, b2 in zip(starts, starts[1:])):
        raise ConfigError(f"{where}: batch sizes must start at 1 and rise strictly (got {', '.join(map(str, starts))})",
                          hint="MTP_BY_BATCH accepts BATCH:K pairs like 1:3,3:2,6:1")
    top = max(s["SEQS"], starts[-1])
    ends = [b - 1 for b in starts[1:]] + [top]
    # a K above MTP is capped to MTP, as vLLM does; build() says so in its warnings
    return [[b, e, min(k, s["MTP"])] for (b, k), e in zip(pairs, ends)]


def schedule_capped(s: Settings) -> int | None:
    """The largest K of MTP_BY_BATCH when it is above MTP (e.g. `flash serve speed MTP=1`)."""
    if not s["MTP_BY_BATCH"] or not s["MTP"]:
        return None
    top = max(int(p.split(":")[1]) for p in s["MTP_BY_BATCH"].split(","))
    return top if top > s["MTP"] else None


def speculative_config(s: Settings) -> dict | None:
    """The `--speculative-config` JSON (None when MTP=0): depth, adaptive depth, block drop."""
    mtp, base = s["MTP"], s["BASE"]
    if not mtp:
        if not s["MTP_BLOCK_DROP"]:
            raise ConfigError("MTP_BLOCK_DROP=0 needs MTP > 0 (there is no drafter whose block to keep)",
                              hint="set MTP, or leave MTP_BLOCK_DROP=1")
        mtp_schedule(s)  # refuses a schedule without MTP
        return None
    spec: dict = {"method": "mtp", "num_speculative_tokens": mtp}
    if s["YARN"]:  # dict hf_overrides do not reach the draft model: give it the length itself
        spec["max_model_len"] = s["CTX"]
    schedule = mtp_schedule(s)
    if schedule:
        spec["num_speculative_tokens_per_batch_size"] = schedule
    if not s["MTP_BLOCK_DROP"]:
        if not releases.has(base, "spec_eagle_block_drop_flag"):
            raise ConfigError(f"MTP_BLOCK_DROP=0: BASE={base}'s vLLM has no disable_eagle_block_drop "
                              "(its SpeculativeConfig refuses unknown keys, so the boot would fail)",
                              hint=f"bases that accept it: {', '.join(sorted(releases.where('spec_eagle_block_drop_flag', True)))}; "
                              "or leave MTP_BLOCK_DROP=1")
        spec["disable_eagle_block_drop"] = True
    return spec


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
    env["VLLM_PLE_MMAP_MODE"] = ple_mode(s)
    vocab = s["DRAFT_VOCAB"]
    if vocab != "0" and s["MTP"]:
        env["VLLM_MTP_DRAFT_VOCAB"] = "default" if vocab == "1" else vocab
    if s["MODE"] in ("hybrid", "hybrid-mtp"):
        env["VLLM_FP8_HYBRID"] = "1"
        env["VLLM_USE_DEEP_GEMM"] = "0"
    if s["EFFORT_ALIAS"] and not releases.has(s["BASE"], "reasoning_effort_map"):
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


# The multi-node settings and the kinds of PARALLEL layout that read them (layout.py, multinode.py):
# set for any other layout they would change nothing, which build() says instead of ignoring them.
MULTI = ("tp", "pp", "tppp", "dp", "pd")
APPLIES_TO = {
    "NODES": MULTI, "NODE_ADDRS": MULTI, "NODE_GPUS": MULTI, "RDMA": MULTI, "LINK_GBPS": MULTI,
    "NODE_IFNAME": ("tp", "pp", "tppp", "dp"), "MASTER_PORT": ("tp", "pp", "tppp"), "DP_RPC_PORT": ("dp",),
    "NIXL_PORT": ("pd",), "PD_PORT": ("pd",), "ROUTER_WORKERS": ("pd",),
}


def inapplicable(s: Settings) -> list[str]:
    """One warning per setting given (profile, env or argument) that the chosen layout never reads."""
    mode = s["PARALLEL"]
    kind = "none" if mode == "none" else layout.parse(mode).kind
    return [f"{key}={s[key]} does nothing with PARALLEL={mode}: only {'/'.join(layout.KIND_FORMS[k] for k in kinds)} read it"
            for key, kinds in APPLIES_TO.items() if s.is_set(key) and kind not in kinds]


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
    parallel: list[str] = (),
    port: int | None = None,
    bind: str | None = None,
    api_key: bool | None = None,
) -> RunSpec:
    """Settings + host facts (resolved snapshot name, absolute HF cache and state paths).
    `parallel`, `port`, `bind` and `api_key` (whether the key is required) are one box's share of
    a multi-node deployment (multinode.py)."""
    name, base = s["NAME"], s["BASE"]
    bind = s["BIND"] if bind is None else bind
    port = s["PORT"] if port is None else port
    image = s["IMAGE"] or default_image(base)
    network = s["NETWORK"]
    warnings: list[str] = []
    if network == "host":
        host, listen_port, ports = bind, port, {}
    else:
        host, listen_port = "0.0.0.0", CONTAINER_PORT
        ports = {f"{CONTAINER_PORT}/tcp": (bind, port)}
    key = needs_api_key(s) if api_key is None else api_key
    exposed = open_api(bind, port, s["API_KEY"])  # the one check (exposure.py): pd's router and doctor share it
    if exposed:
        warnings.append(exposed)
    if s["PAD_M4"]:
        warnings.append("PAD_M4 has no effect: M%4 padding is upstream in every supported vLLM release")
    capped = schedule_capped(s)
    if capped:
        warnings.append(f"MTP_BY_BATCH={s['MTP_BY_BATCH']} asks for up to {capped} draft tokens; MTP={s['MTP']} caps "
                        f"every step at {s['MTP']} (raise MTP to use the schedule)")
    if s["CTX"] > NATIVE_CTX and not s["YARN"]:
        warnings.append(f"CTX={s['CTX']} is above the native {NATIVE_CTX} without YARN=1: vLLM will refuse it")
    warnings += inapplicable(s)
    lay = known.for_model(s["MODEL"])
    if lay is not None and lay.unproven and not ple_patch_off(s):
        warnings.append(f"{s['MODEL']}: {lay.unproven}")

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
    # The healthcheck runs inside the container: bridge → vLLM listens on 0.0.0.0 there, so
    # loopback answers; host network → vLLM listens on BIND only, so probe that address.
    probe = ["--health", str(listen_port)] + ([host] if network == "host" and host not in ("0.0.0.0", "::", "127.0.0.1") else [])
    return RunSpec(
        name=name,
        image=image,
        entrypoint=["python3", "-m", "flash_vllm.launch"],
        command=vllm_args(s, snapshot, host, listen_port, parallel),
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
        healthcheck={"test": ["CMD", "python3", "-m", "flash_vllm.launch", *probe], "interval": 30 * 10**9,
                     "timeout": 10 * 10**9, "retries": 3, "start_period": 1800 * 10**9},
        api_url=f"http://{url_host}:{port}",
        warnings=warnings,
        needs_api_key=key,
        key_file=key_file,
    )
