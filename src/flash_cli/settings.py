"""The one typed settings table, and the layered loader.

Every variable the recipe understands is declared once in SETTINGS: type, default, allowed
values, doc and where the value goes (docker option, container env, `vllm serve` argument).
`serve`, `doctor`, `--dry-run`, `scripts/serve.sh` and docs/SETTINGS.md all read this table.

Precedence: defaults < profile < environment < KEY=VALUE arguments. Loaders take the env
mapping and the argument list explicitly (never os.environ / sys.argv) so tests inject them.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
import unicodedata
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from flash_common import releases

from . import layout, nodes
from .errors import ConfigError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")
SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
# Every value ends up in argv, an env var, a label, a path or a systemd unit: longer than a path
# may be (PATH_MAX) is a mistake, never a recipe. Settings that become one path component
# (REVISION: snapshots/<rev>) set a tighter `max_len` (NAME_MAX).
MAX_LEN = 4096
NAME_MAX = 255
# Numbers cross into Docker (Go int64) and vLLM: past int64 nothing downstream can hold them.
INT64_MAX = 2**63 - 1


def bad_char(raw: str) -> str | None:
    """The first control character (NUL, newline, ESC, DEL, C1) or lone surrogate (undecodable
    bytes from argv/env) in `raw`: none of them has a meaning in any setting, and each breaks
    something downstream (a NUL in a path, a newline in a systemd unit, a label Docker refuses)."""
    for ch in raw:
        if unicodedata.category(ch) in ("Cc", "Cs"):
            return ch
    return None


def shown(raw: str, limit: int = 60) -> str:
    """`raw` as an error message shows it: repr, cut to `limit` characters with the full length named."""
    r = repr(raw)
    return r if len(r) <= limit else f"{r[:limit]}… ({len(raw):,} characters)"


def _parse_bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise ValueError("expected 0/1 (also true/false, yes/no, on/off)")


def _parse_int(raw: str) -> int:
    v = raw.strip().replace("_", "")
    if not re.fullmatch(r"[+-]?\d+", v):
        raise ValueError("expected an integer")
    return int(v)


def _parse_float(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("expected a number") from None
    if not math.isfinite(value):  # nan passes every min/max comparison; 1e309 reads as inf
        raise ValueError("expected a finite number (not nan, inf or beyond 1.8e308)")
    return value


def parse_size(raw: str) -> int:
    """`8G`, `512m`, `1073741824` → bytes (binary units, like docker and vLLM's own parser)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", raw.strip().lower())
    if not m:
        raise ValueError("expected a size like 17179869184, 16G or 512M")
    try:
        return int(float(m.group(1)) * SIZE_UNITS[m.group(2)])
    except OverflowError:  # 400 digits: float() says inf
        raise ValueError("too large") from None


@dataclass(frozen=True)
class Setting:
    """One variable. `goes` says where it ends up; `env` names a container variable that
    receives the value verbatim (formatted by `to_env`)."""

    name: str
    kind: str  # bool | int | float | str | choice | size | host
    default: Any
    doc: str
    goes: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    pattern: str | None = None
    env: str | None = None
    optional: bool = False  # empty string means "unset" (default None)
    secret: bool = False
    max_len: int = MAX_LEN
    check: Callable[[str], None] | None = None  # what a pattern cannot say; raises ConfigError

    def parse(self, raw: str) -> Any:
        if not isinstance(raw, str):
            raise ConfigError(f"{self.name}={raw!r} is not text", hint=f"{self.name} accepts {self.accepted()}")
        bad = bad_char(raw)
        if bad is not None:
            raise ConfigError(f"{self.name}={shown(raw)} contains the control character {bad!r}",
                              hint=f"{self.name} accepts {self.accepted()}, printable characters only")
        if len(raw) > self.max_len:
            raise ConfigError(f"{self.name}={shown(raw)} is too long ({len(raw):,} characters, at most {self.max_len:,})",
                              hint=f"{self.name} accepts {self.accepted()}, at most {self.max_len:,} characters")
        if self.optional and raw.strip() == "":
            return None
        try:
            if self.kind == "bool":
                value: Any = _parse_bool(raw)
            elif self.kind == "int":
                value = _parse_int(raw)
            elif self.kind == "float":
                value = _parse_float(raw)
            elif self.kind == "size":
                value = parse_size(raw)
            elif self.kind == "choice":
                value = raw.strip()
                if value not in self.choices:
                    if self.check is not None:  # says why this value is refused, where it knows
                        self.check(value)
                    raise ValueError("not one of the allowed values")
            elif self.kind == "host":
                value = raw.strip()
                ipaddress.ip_address(value)
            else:
                value = raw
        except ValueError as exc:
            raise ConfigError(
                f"{self.name}={shown(raw)} is not valid: {exc}",
                hint=f"{self.name} accepts {self.accepted()}",
            ) from None
        if self.minimum is not None and value < self.minimum or self.maximum is not None and value > self.maximum:
            raise ConfigError(f"{self.name}={shown(raw)} is out of range", hint=f"{self.name} accepts {self.accepted()}")
        if self.kind in ("int", "size") and abs(value) > INT64_MAX:
            raise ConfigError(f"{self.name}={shown(raw)} is out of range (beyond a 64-bit integer)",
                              hint=f"{self.name} accepts {self.accepted()}")
        if self.check is not None and value is not None:  # first: it names the bad part precisely
            self.check(value)
        if self.pattern and isinstance(value, str) and not re.fullmatch(self.pattern, value):
            raise ConfigError(f"{self.name}={shown(raw)} is not valid", hint=f"{self.name} accepts {self.accepted()}")
        return value

    def accepted(self) -> str:
        if self.kind == "choice":
            return " | ".join(repr(c) if c == "" else c for c in self.choices) + (" (empty: unset)" if self.optional else "")
        if self.kind == "bool":
            return "0 or 1"
        if self.kind == "host":
            return "an IP address (127.0.0.1 keeps the API on this machine)"
        if self.kind == "size":
            return "a byte count or a size like 16G" + (" (empty: unset)" if self.optional else "")
        rng = ""
        if self.minimum is not None or self.maximum is not None:
            rng = f" in [{self.minimum if self.minimum is not None else '-inf'}, {self.maximum if self.maximum is not None else 'inf'}]"
            rng = rng.replace(".0,", ",").replace(".0]", "]")
        what = {"int": "an integer", "float": "a number", "str": "text"}[self.kind]
        if self.pattern:
            what += f" matching {self.pattern}"
        return what + rng + (" (empty: unset)" if self.optional else "")

    def format(self, value: Any) -> str:
        """Back to the string form (for env files, docs, container env)."""
        if value is None:
            return ""
        if self.kind == "bool":
            return "1" if value else "0"
        if self.kind == "float":
            return f"{value:g}" if value != int(value) else f"{value:.2f}"
        return str(value)


BASES = releases.newest_first()   # the catalogue's bases (flash_common.releases), newest first
CURRENT_BASE = releases.CURRENT

S = Setting
SETTINGS: tuple[Setting, ...] = (
    # --- identity and image ---------------------------------------------------------------
    S("NAME", "str", "qwen38-flash", "Container name (also the label value flash finds it by).",
      "docker --name, label org.flash.name", pattern=r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}"),
    S("BASE", "choice", CURRENT_BASE, "vLLM release line the image is built on; picks the Dockerfile, "
      "graph regime and which patches apply. Profiles set it with `# base:` (`current`: the catalogue's current base).",
      "image tag, Dockerfile choice, compilation flags, label org.flash.base", choices=BASES),
    S("IMAGE", "str", None, "Image to run. Empty: flash-vllm:<BASE>, built by `flash setup`.",
      "docker image", optional=True, pattern=r"[a-zA-Z0-9][\w./:@-]*"),
    S("BASE_IMAGE", "str", None, "Build `flash setup`'s image FROM this instead of the Dockerfile's pinned "
      "vLLM image (a local test base, a newer digest).", "docker build --build-arg BASE_IMAGE", optional=True,
      pattern=r"[a-zA-Z0-9][\w./:@-]*"),
    S("SELFCHECK", "bool", True, "Run the plugin self-check as the image's last build step (0 only for test "
      "bases without vLLM; the image is then labelled selfcheck=skipped).", "docker build --build-arg SELFCHECK"),
    S("MODEL", "str", "nvidia/Qwen3.8-Flash-Next-NVFP4", "Hugging Face repo of the checkpoint.",
      "snapshot path under HF_CACHE (served offline)", pattern=r"[\w.-]+/[\w.-]+",
      max_len=NAME_MAX - len("models----")),  # models--ORG--NAME is one path component
    S("REVISION", "str", None, "Commit to serve and download (empty: what refs/main points to).",
      "snapshot choice; download revision", optional=True, pattern=r"[\w.-]+", max_len=NAME_MAX),
    S("SERVED_MODEL_NAME", "str", "qwen3.8-flash-next", "Model id clients send.",
      "vllm --served-model-name", pattern=r"[\w.:/-]+"),
    S("HF_CACHE", "str", "~/.cache/huggingface", "Host Hugging Face cache (holds hub/models--…).",
      "docker bind HF_CACHE:/hf (read-only), env HF_HOME=/hf"),
    S("MODE", "choice", "nvfp4", "Checkpoint layout: nvfp4 = as published, hybrid = fp8 side layers "
      "(<snapshot>-fp8hybrid), hybrid-mtp = hybrid + NVFP4 MTP experts graft (RadixArk only).",
      "model path; env VLLM_FP8_HYBRID=1, VLLM_USE_DEEP_GEMM=0", choices=("nvfp4", "hybrid", "hybrid-mtp")),
    # --- download (flash download, scripts/download-weights.sh) ------------------------------
    S("EXCLUDE", "str", None, "Space-separated globs of repo files not to download (e.g. '*.complete.json "
      "qualification-notes.md'). A file the index names is never excluded.", "huggingface_hub ignore_patterns",
      optional=True),
    S("MAX_WORKERS", "int", 8, "Parallel file downloads.", "huggingface_hub max_workers", minimum=1, maximum=64),
    S("XET", "bool", True, "Download through Xet (files over 50 GB only come that way); 0 = plain HTTPS.",
      "host env HF_HUB_DISABLE_XET, HF_XET_HIGH_PERFORMANCE"),
    # --- patches and kernels ---------------------------------------------------------------
    S("PREFIX_CACHE", "bool", True, "Prefix caching.", "vllm --enable-prefix-caching / --no-enable-prefix-caching"),
    S("PREFIX_RETAIN", "choice", "0", "Which Mamba states the prefix cache keeps (docs/PREFIX-CACHE.md). 0 = "
      "vLLM's default: a prompt's last block boundary and shared-prefix junctions, so the second of two prompts "
      "that share a prefix and then differ by more than a block misses, the third hits. dense = also the state "
      "every prefill chunk ends on (each BATCHED_TOKENS step): that second prompt hits from the first chunk end "
      "(8,000 tokens by default); more cached states compete for the pool's free blocks. Not yet run on a GPU.",
      "vllm --prefix-cache-retention-interval (dense: None)", choices=("0", "dense")),
    S("DET_TOPK", "choice", "repair", "Deterministic QSA block top-k (patch 8): 0 off (the stock kernel), "
      "repair = the stock kernel, then a Triton pass that makes its selection exact and deterministic (ties to "
      "the lowest column; 1.9-3.4x the stock kernel alone on the H200, run44), 1 = exact torch.topk over the "
      "whole row (10-40x), radix = a Triton radix select over the visible columns (2.4-11x); see "
      "benchmarks/decode-h200/KERNELS.md. repair's cost in a whole decode step: 0.7-0.9% at 4-8 streams "
      "(0.05-0.12 ms, 32 layers on an H100, benchmarks/recipe48-h200 run7); 0 buys that back and gives up "
      "repeatable block selection past the QSA budget.", "env VLLM_QSA_DET_TOPK",
      choices=("0", "1", "radix", "repair"), env="VLLM_QSA_DET_TOPK"),
    S("EXACT_TOPK", "choice", "0", "Exact torch.topk QSA path (patch 5): 0 off, 1 exact, fill = exact "
      "with masked fill. Wins over DET_TOPK.", "env VLLM_QSA_EXACT_TOPK", choices=("0", "1", "fill"),
      env="VLLM_QSA_EXACT_TOPK"),
    S("PAD_M4", "bool", False, "M%4 padding for blockwise fp8 GEMM. Upstream in every supported release; "
      "accepted for compatibility, has no effect.", "nothing (documented no-op)"),
    S("DRAFT_VOCAB", "str", "1", "Reduced MTP draft vocabulary (patch 10): 0 off, 1 the shipped 65,536-id "
      "set, or a path inside the container to an .npy of token ids.", "env VLLM_MTP_DRAFT_VOCAB",
      pattern=r"0|1|/[\w./-]+\.npy"),
    S("MADVISE", "choice", "random", "madvise on the mmapped PLE table.", "env VLLM_PLE_MMAP_MADVISE",
      choices=("random", "normal"), env="VLLM_PLE_MMAP_MADVISE"),
    S("FAST_ROWS", "int", 0, "PLE gathers up to this many rows run inline (0: strategy picks).",
      "env VLLM_PLE_MMAP_FAST_ROWS", minimum=0, env="VLLM_PLE_MMAP_FAST_ROWS"),
    S("WORKERS", "int", 32, "PLE gather worker threads for prefill-sized batches.", "env VLLM_PLE_MMAP_WORKERS",
      minimum=1, maximum=256, env="VLLM_PLE_MMAP_WORKERS"),
    S("PREWARM", "bool", False, "Read the PLE table once at boot to warm the page cache.",
      "env VLLM_PLE_MMAP_PREWARM", env="VLLM_PLE_MMAP_PREWARM"),
    S("PLE_MODE", "choice", "auto", "Where the PLE rows are gathered: eager (inside the forward, PIECEWISE "
      "graphs), hoisted (before the forward from the runner's inputs, FULL decode graphs; v0.30-v0.33), or "
      "auto: hoisted on the bases that serve it, eager elsewhere (measured 2.2-2.9x eager's decode, "
      "greedy output identical: benchmarks/decode-h200).",
      "env VLLM_PLE_MMAP_MODE (auto resolved per base); picks cudagraph_mode", choices=("auto", "eager", "hoisted")),
    S("EFFORT_ALIAS", "bool", True, "Accept reasoning effort high/max (→ xhigh) and minimal (→ low), as "
      "Claude Code sends them.", "v0.33: vllm --reasoning-effort-map; older: env FLASH_EFFORT_ALIAS (plugin)"),
    S("TOOL_PARSER", "str", "qwen3_coder", "vLLM's tool-call parser for this model's `<tool_call>` output "
      "(qwen3_coder; NVIDIA's recipes name qwen3_xml, which reads the same format).",
      "vllm --tool-call-parser (with --enable-auto-tool-choice)", pattern=r"[a-z][a-z0-9_]{0,63}"),
    S("LOG_REQUESTS", "bool", False, "Log prompts and outputs (DEBUG on vLLM's request logger only).",
      "vllm --enable-log-requests --enable-log-outputs"),
    # --- engine ------------------------------------------------------------------------------
    S("CTX", "int", 262144, "Maximum model length in tokens.", "vllm --max-model-len (and the draft's "
      "max_model_len under YaRN)", minimum=1024, maximum=1048576),
    S("YARN", "bool", False, "YaRN ×4 rope scaling (needed above 262,144 tokens).",
      "vllm --hf-overrides; env VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"),
    S("SEQS", "int", 8, "Maximum concurrent sequences.", "vllm --max-num-seqs", minimum=1, maximum=256),
    S("GPU_MEM", "float", 0.80, "Fraction of the unified memory vLLM may use.", "vllm --gpu-memory-utilization",
      minimum=0.05, maximum=0.95),
    S("MTP", "int", 2, "MTP speculative tokens (0 = off). Each draft token lengthens every step, accepted or not: "
      "from 2 to 4, 1.31x a step at 4 streams (32 layers, an H100, recipe48 run8), which pays there only if each "
      "draft is accepted with p > 0.74 at least (a flat-acceptance model: vLLM logging a mean acceptance length "
      "above 2.29 at MTP=2). On a Spark, an estimate from a step model: p > 0.64-0.69 for one stream, "
      "0.78-0.81 at 4-8. `flash status` prints a running server's acceptance by draft position.",
      "vllm --speculative-config", minimum=0, maximum=8),
    S("KV_DTYPE", "choice", "auto", "KV cache dtype (fp8 needs v0.33 or a patched image).",
      "vllm --kv-cache-dtype", choices=("auto", "bfloat16", "fp8", "fp8_e4m3")),
    S("KV_CACHE_MEM", "size", None, "Fixed KV cache size (overrides the GPU_MEM budget for KV).",
      "vllm --kv-cache-memory-bytes", optional=True),
    S("BATCHED_TOKENS", "int", 8192, "Prefill chunk: maximum tokens per scheduler step.",
      "vllm --max-num-batched-tokens", minimum=256, maximum=131072),
    S("LONG_PREFILL", "int", 0, "Most prompt tokens a long prompt gets per step while other requests run "
      "(vLLM's --long-prefill-token-threshold), so their streams keep decoding; 0 = vLLM's default (no cap: a "
      "long prompt takes the whole BATCHED_TOKENS step). From vLLM 0.31 a prompt alone on the server is not "
      "cut (the scheduler drops the cap with nobody to starve); 0.29 and 0.30 cut it even then. With prefix "
      "caching a value that does not divide the KV block gives uneven pieces: `flash plan` names the even one "
      "(docs/PREFIX-CACHE.md).",
      "vllm --long-prefill-token-threshold", minimum=0, maximum=131072),
    S("GRAPH_TOKENS", "int", 0, "Largest step, in tokens, that runs inside CUDA graphs (vLLM's "
      "max_cudagraph_capture_size); 0 = vLLM's choice (2 x SEQS x (1 + MTP), at most 512). A larger step runs "
      "outside graphs, ~140 ms at 32 layers on an H100 (benchmarks/latency48-h100). `shared` sets it to cover "
      "a LONG_PREFILL piece beside every stream, for more graph memory (1.08 against 0.31 GiB there); "
      "`flash plan` warns where such a step does not fit and names the size that does.",
      "vllm -cc max_cudagraph_capture_size", minimum=0, maximum=131072),
    S("COMPILE_FLAGS", "str", None, "Replaces the compilation flags flash picks per base (upstream's CC, "
      "renamed: CC is the C compiler's variable). Split with shlex. Must keep cudagraph_mode PIECEWISE or "
      "NONE unless the PLE gather is hoisted (PLE_MODE auto on v0.30+, or hoisted; checked before a boot: "
      "FULL graphs would replay the eager gather).", "vllm -cc.* arguments", optional=True),
    S("EXTRA", "str", None, "Extra `vllm serve` arguments, split once with shlex (quotes work).",
      "vllm argv (appended)", optional=True),
    S("CONTAINER_ENV", "str", None, "Extra container environment, `KEY=VALUE` words split with shlex "
      "(e.g. NCCL_DEBUG=INFO). Applied after flash's own; secrets do not belong here (use API_KEY).",
      "docker -e", optional=True),
    S("PROM_MULTIPROC", "bool", False, "Prometheus multiprocess mode (not needed: the PLE counters reach "
      "/metrics without it).", "docker tmpfs /tmp/vllm-prometheus, env PROMETHEUS_MULTIPROC_DIR"),
    S("COMPILE_CACHE", "str", "flash-compile", "Persist torch.compile/FlashInfer/Triton caches: a docker "
      "volume name, an absolute host path, or empty for none.", "docker volumes/binds on /root/.cache/{vllm,flashinfer,triton}",
      optional=True, pattern=r"/.*|[a-zA-Z0-9][a-zA-Z0-9_.-]*"),
    # --- ours: network, security, operations -----------------------------------------------------
    S("PORT", "int", 18300, "Host port of the API.", "docker -p BIND:PORT:8000", minimum=1, maximum=65535),
    S("BIND", "host", "127.0.0.1", "Host address the API is published on. Anything but loopback needs "
      "an API key (API_KEY=auto) or API_KEY=off.", "docker -p BIND:PORT:8000"),
    S("API_KEY", "choice", "auto", "auto: a key is generated once (0600 in the state dir) and required "
      "when BIND is not loopback; on: always require it; off: never (loud when exposed).",
      "key file mounted read-only; the launcher exports it inside the container (never argv or env)",
      choices=("auto", "on", "off")),
    S("NETWORK", "choice", "bridge", "bridge: publish BIND:PORT to the container's 8000; host: vLLM itself "
      "listens on BIND:PORT in the host's network.", "docker --network / -p; vllm --host --port",
      choices=("bridge", "host")),
    S("GPUS", "choice", "all", "GPUs given to the container (none: only for test images).", "docker --gpus",
      choices=("all", "none")),
    S("RESTART", "choice", "unless-stopped", "Docker restart policy.", "docker --restart",
      choices=("unless-stopped", "no", "always", "on-failure")),
    S("SHM_SIZE", "size", 16 * 1024**3, "Shared memory for the container.", "docker --shm-size"),
    S("LOG_MAX_SIZE", "str", "100m", "Rotate the container log at this size.", "docker --log-opt max-size",
      pattern=r"\d+[kmg]"),
    S("LOG_MAX_FILES", "int", 3, "Rotated log files kept.", "docker --log-opt max-file", minimum=1, maximum=100),
    S("CPUSET", "str", None, "Pin the container to these CPUs (e.g. 5-9,15-19 = the Spark's X925 cores).",
      "docker --cpuset-cpus", optional=True, pattern=r"[0-9,-]+"),
    S("TIMEOUT", "int", 1800, "`flash wait`: seconds before giving up.", "flash wait", minimum=1),
    S("DRAIN_TIMEOUT", "int", 60, "`flash stop`: seconds to wait for running requests to finish.",
      "flash stop", minimum=0, maximum=3600),
    S("PAGE_CACHE_MIN", "size", 6 * 1024**3, "`flash plan`/`doctor`: warn when the memory left to the page cache "
      "for the 47.7 GiB PLE table is below this.", "flash plan, flash doctor (warning threshold)"),
    # --- gates, benchmarks, monitoring (flash test / probe / bench / monitor) ----------------------
    S("TEST_MIN_PREFILL_TPS", "float", 200.0, "`flash test` prefill: cold prompt tokens/s below this fail "
      "(a healthy Spark does ~2,000; this catches a swapping or misconfigured box).", "flash test", minimum=0),
    S("TEST_MIN_DECODE_TPS", "float", 10.0, "`flash test` decode: tokens/s of a real greedy answer below this "
      "fail (single stream ~35 on a Spark).", "flash test", minimum=0),
    S("TEST_PREFILL_TOKENS", "int", 8192, "`flash test` prefill/prefix_cache: prompt size in tokens (scaled down to fit the server's max_model_len; "
      "measured with the server's /tokenize and trimmed to fit, an estimate where it has none, as the detail says).",
      "flash test", minimum=64, maximum=1048576),
    S("TEST_DECODE_TOKENS", "int", 400, "`flash test` decode: max_tokens of the answer (never ignore_eos).",
      "flash test", minimum=8, maximum=32768),
    S("TEST_DET_RUNS", "int", 3, "`flash test` determinism: identical greedy requests compared.", "flash test",
      minimum=2, maximum=50),
    S("TEST_DET_TOKENS", "int", 32, "`flash test` determinism: max_tokens of each compared answer.", "flash test",
      minimum=1, maximum=4096),
    S("TEST_LOGPROB_TOL", "float", 1e-6, "`flash test` determinism: largest allowed difference between "
      "first-token top logprobs.", "flash test", minimum=0),
    S("TEST_MIN_PREFIX_HIT", "float", 0.5, "`flash test` prefix_cache: share of the repeated prompt's tokens "
      "that must register in vllm:prefix_cache_hits_total.", "flash test", minimum=0, maximum=1),
    S("TEST_TIMEOUT", "int", 600, "`flash test`/`probe`/`bench`: seconds one request may take.", "HTTP timeout",
      minimum=1, maximum=7200),
    S("BENCH_CONCURRENCY", "str", "1,2,4,8", "`flash bench` decode: concurrency levels, comma separated.",
      "flash bench", pattern=r"\d{1,3}(,\d{1,3})*"),
    S("BENCH_PREFILL", "str", "8192,32768", "`flash bench` prefill: prompt sizes in tokens, comma separated.",
      "flash bench", pattern=r"\d{2,7}(,\d{2,7})*"),
    S("BENCH_REPEATS", "int", 3, "`flash bench`: repetitions of every measurement (medians and spread).",
      "flash bench", minimum=1, maximum=100),
    S("BENCH_DECODE_TOKENS", "int", 256, "`flash bench` decode: max_tokens per request (a real answer).",
      "flash bench", minimum=8, maximum=32768),
    S("MONITOR_BIND", "host", "127.0.0.1", "`flash monitor`: address Grafana listens on. Loopback: Grafana "
      "lets anonymous users view. Anything else: Grafana requires a login (admin password file in the "
      "state dir). Prometheus and node-exporter have no authentication and always stay on 127.0.0.1.",
      "env GF_SERVER_HTTP_ADDR, GF_AUTH_ANONYMOUS_ENABLED"),
    S("MONITOR_PROM_PORT", "int", 19090, "`flash monitor`: Prometheus listens on 127.0.0.1:this port.",
      "prometheus --web.listen-address", minimum=1, maximum=65535),
    S("MONITOR_GRAFANA_PORT", "int", 13000, "`flash monitor`: Grafana listens on MONITOR_BIND:this port.",
      "env GF_SERVER_HTTP_PORT", minimum=1, maximum=65535),
    S("MONITOR_NODE_PORT", "int", 19100, "`flash monitor`: node-exporter listens on 127.0.0.1:this port.",
      "node_exporter --web.listen-address", minimum=1, maximum=65535),
    # --- field lessons (issue 16): default effort, adaptive MTP, boot stalls, memory pressure ---
    S("EFFORT_DEFAULT", "choice", None, "The server's default reasoning effort for requests that send none "
      "(empty: the chat template's own default, xhigh). One recipe found xhigh made 23 of 42 agent runs think "
      "without end, 0 of 42 at medium (checks passed 42.5% -> 95.9%): profile `agent` sets medium. A request's "
      "own reasoning_effort still wins.", "vllm --default-chat-template-kwargs {\"reasoning_effort\": …} (every base)",
      choices=("low", "medium", "xhigh"), optional=True),
    S("MTP_BY_BATCH", "str", None, "Adaptive MTP depth: `BATCH:K` pairs, ascending from batch size 1, each K "
      "used from that many running requests up (e.g. 1:3,3:2,6:1 = 3 draft tokens for 1-2 requests, 2 for 3-5, "
      "1 from 6). A K above MTP is capped to MTP (with a warning). Empty: MTP tokens at every batch size.",
      "vllm --speculative-config num_speculative_tokens_per_batch_size (bases that accept it)",
      optional=True, pattern=r"\d+:\d+(,\d+:\d+)*"),
    S("MTP_BLOCK_DROP", "bool", True, "Drop the trailing prefix-cache block for the MTP drafter (vLLM's default). "
      "0 keeps it: one recipe measured turn-1 TTFT 3.25 s -> 0.63 s with the drop off. Refused on bases "
      "without the option.", "vllm --speculative-config disable_eagle_block_drop (v0.30+)"),
    S("BOOT_STALL", "int", 600, "`flash wait`: a boot that prints nothing new for this many seconds in a known "
      "phase (weights, compile, KV allocation, graph capture) is reported with the phase and its remedy "
      "(0: never). Waiting goes on until TIMEOUT.", "flash wait", minimum=0, maximum=86400),
    S("MEM_PRESSURE_WARN", "float", 10.0, "`flash doctor`/`status`: warn when /proc/pressure/memory `some` "
      "avg60 (percent of time tasks stalled on memory) is above this (direct reclaim, PLE pages evicted).",
      "flash doctor, flash status (warning threshold)", minimum=0, maximum=100),
    # --- memory guard (issue 36; docs/GUARD.md) -------------------------------------------------
    S("GUARD", "bool", True, "The memory watchdog: a sidecar container NAME-guard that stops the server "
      "gracefully (docker stop, GUARD_GRACE) when PSI `full` avg10 stays above GUARD_PSI_FULL for GUARD_HOLD "
      "seconds, before the kernel locks the box; the reason is in its log and `flash status`. One-box servers.",
      "sidecar container NAME-guard (python3 -m flash_common.memguard, the server's image)"),
    S("GUARD_SOURCE", "choice", "host", "Pressure the guard reads: host = /proc/pressure/memory (the whole box: "
      "on a unified-memory Spark any process can squeeze the server's pool); container = the server's own cgroup "
      "memory.pressure (a server under a memory limit).", "memguard --source", choices=("host", "container")),
    S("GUARD_PSI_FULL", "float", 25.0, "PSI `full` avg10 (percent of the last 10 s in which every task stalled on "
      "memory) above which the hold time runs. Below systemd-oomd's kill line (60% for 30 s), so the graceful stop "
      "comes first.", "memguard --threshold", minimum=1, maximum=99),
    S("GUARD_HOLD", "int", 20, "Seconds the pressure must stay above GUARD_PSI_FULL before the server is stopped.",
      "memguard --hold", minimum=2, maximum=3600),
    S("GUARD_GRACE", "int", 30, "Seconds Docker waits after SIGTERM before SIGKILL when the guard stops the server.",
      "memguard --grace (docker stop -t)", minimum=1, maximum=600),
    S("GUARD_PORT", "int", 19101, "The guard's Prometheus /metrics on 127.0.0.1:this port (0: none).",
      "memguard --metrics", minimum=0, maximum=65535),
    S("GUARD_MARGIN", "size", 4 * 1024**3, "`flash serve`: start only while MemAvailable is at least what `flash "
      "plan` says the recipe claims plus this.", "flash serve (memory check before a start)"),
    S("GUARD_WAIT", "int", 0, "`flash serve`: seconds to wait for that memory before refusing (0: refuse at once; "
      "--wait-memory sets it).", "flash serve (memory check before a start)", minimum=0, maximum=86400),
    # --- 2 to 4 boxes: vLLM's own multi-node modes (issues 15, 35; docs/MULTINODE.md) ---------
    S("PARALLEL", "choice", "none", "Spread one deployment over the 2-4 boxes in NODES (one GPU each) with "
      "vLLM's own launch; the digit is the box count. tpN = tensor parallel (--nnodes/--node-rank/--master-addr, "
      "headless workers; N must fit the model's head counts: 2 or 4, not 3); tpNep = the same with expert "
      "parallel (tp4ep: the 4-Spark anchor); ppN = pipeline parallel; tp2pp2 = tensor 2 x pipeline 2; dpN = N "
      "data-parallel replicas behind the head's one API (headless workers); pd = prefill on the first box, decode "
      "on the second (NixlConnector), flash's P/D router on the first box serving the one API; pdN = one prefill "
      "and N-1 decode boxes behind it. none = one box.",
      "vllm parallel/kv-transfer flags per box; labels org.flash.parallel",
      choices=("none", *layout.ACCEPTED), check=layout.check),
    S("NODES", "str", None, "The boxes of a PARALLEL deployment, head first, comma separated: `localhost` "
      "(this machine's engine), a host name or user@host (= ssh://, docker-py's ssh transport), or an engine "
      "URL ssh://…, tcp://…, unix://….", "one Docker Engine per box; label org.flash.nodes", optional=True,
      pattern=r"[\w@.:/+-]+(,[\w@.:/+-]+)*", check=nodes.check),
    S("NODE_ADDRS", "str", None, "Each box's IP address on the fast link (ConnectX-7), same order as NODES; "
      "the first is the master/data-parallel address. 127.0.0.1 twice = two ranks on one host.",
      "vllm --master-addr / --data-parallel-address; env VLLM_HOST_IP, VLLM_NIXL_SIDE_CHANNEL_HOST",
      optional=True, pattern=r"[0-9a-fA-F.:]+(,[0-9a-fA-F.:]+)*"),
    S("NODE_GPUS", "str", None, "GPUs each box's rank uses, one entry per box (`+` joins several): `0,1` "
      "puts rank 0 on GPU 0 and rank 1 on GPU 1 (two ranks sharing one host). Empty: all GPUs of the box.",
      "docker --gpus device=…; CUDA_VISIBLE_DEVICES in the plain launch (serve --dry-run --json)",
      optional=True, pattern=r"\d+(\+\d+)*(,\d+(\+\d+)*)*"),
    S("NODE_IFNAME", "str", None, "Network interface of the fast link (e.g. enp1s0f1np1), so NCCL's and "
      "gloo's bootstrap sockets do not pick the management network.",
      "env NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME (multi-node boxes only)", optional=True,
      pattern=r"[\w.:-]+"),
    S("MASTER_PORT", "int", 29501, "torch.distributed rendezvous port on the head (tp/pp layouts).",
      "vllm --master-port", minimum=1024, maximum=65535),
    S("DP_RPC_PORT", "int", 29550, "Data-parallel handshake port on the head (dp layouts).",
      "vllm --data-parallel-rpc-port", minimum=1024, maximum=65535),
    S("NIXL_PORT", "int", 5600, "NIXL side-channel port (pd layouts); box N uses NIXL_PORT+N so ranks can share a host.",
      "env VLLM_NIXL_SIDE_CHANNEL_PORT", minimum=1024, maximum=65535),
    S("PD_PORT", "int", 18310, "pd layouts: API port of the prefill server (box 0); the decode server on box N "
      "uses PD_PORT+N. Each listens on its NODE_ADDRS address, where the router reaches it; users talk to the "
      "router on BIND:PORT, the deployment's one endpoint.",
      "vllm serve --host NODE_ADDR --port on the pd servers; pdrouter --prefill/--decode URLs",
      minimum=1024, maximum=65534),
    S("ROUTER_WORKERS", "int", 0, "pd layouts: worker processes of the P/D router, all accepting on BIND:PORT "
      "(one event loop spends ~1.4 ms CPU per request, so 200 at once queue behind one core). 0: min(4, the "
      "router container's CPU cores); 1: one process. The connection cap is shared; /metrics sums the workers.",
      "pdrouter --workers", minimum=0, maximum=64),
    S("RDMA", "bool", True, "Give multi-node containers the RDMA devices and limits NCCL needs for "
      "GPUDirect over ConnectX (without them NCCL silently falls back to TCP at about half speed). "
      "0 only for test boxes without /dev/infiniband.",
      "docker --device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1:-1 (multi-node boxes only)"),
    S("LINK_GBPS", "int", 200, "`flash doctor`: the rate the fast link must report (ConnectX-7 on a Spark: 200).",
      "flash doctor (deployment checks)", minimum=1, maximum=3200),
)
del S

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def closest(key: str) -> str | None:
    hits = difflib.get_close_matches(key.upper(), BY_NAME, n=1, cutoff=0.5)
    return hits[0] if hits else None


def lookup(key: str, where: str) -> Setting:
    try:
        return BY_NAME[key]
    except KeyError:
        guess = closest(key)
        hint = f"did you mean {guess}?" if guess else "see docs/SETTINGS.md or `flash profiles show default`"
        raise ConfigError(f"unknown setting {key!r} ({where})", hint=hint) from None


@dataclass
class Settings:
    """Resolved values plus where each came from (default / profile:NAME / env / arg)."""

    values: dict[str, Any]
    source: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def is_set(self, key: str) -> bool:
        return self.source.get(key, "default") != "default"

    def as_env(self) -> dict[str, str]:
        return {k: BY_NAME[k].format(v) for k, v in self.values.items()}

    def overrides(self) -> dict[str, str]:
        """The values that differ from the defaults (what a container label records)."""
        return {k: BY_NAME[k].format(v) for k, v in self.values.items()
                if v != BY_NAME[k].default and not BY_NAME[k].secret}

    def digest(self) -> str:
        """Stable hash of the recipe: the values that differ from the table's defaults (so adding
        a setting does not change every hash); the image label org.flash.version covers the rest."""
        import hashlib

        text = "\n".join(f"{k}={v}" for k, v in sorted(self.overrides().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_assignments(args: Iterable[str], where: str) -> dict[str, str]:
    """`KEY=VALUE` arguments → dict; anything else is a usage error."""
    out: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"override must look like KEY=VALUE, got {arg!r} ({where})")
        lookup(key, where)
        out[key] = value
    return out


def resolve(
    profile_values: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
    profile_name: str = "",
    extra_layers: Iterable[tuple[str, Mapping[str, str]]] = (),
) -> Settings:
    """Layer defaults < profile < environment < overrides; validate every value that is set.

    The environment layer reads only keys of the table (a stray `CC=gcc` is not ours), and
    only non-empty values for keys that are not optional, so an exported empty variable
    cannot silently mask the profile (an upstream footgun).
    """
    values = {s.name: s.default for s in SETTINGS}
    source = {s.name: "default" for s in SETTINGS}
    layers: list[tuple[str, Mapping[str, str]]] = []
    if profile_values:
        layers.append((f"profile:{profile_name}" if profile_name else "profile", profile_values))
    layers.extend(extra_layers)
    if env:
        layers.append(("env", {k: v for k, v in env.items() if k in BY_NAME and (v != "" or BY_NAME[k].optional)}))
    if overrides:
        layers.append(("arg", overrides))
    for where, layer in layers:
        for key, raw in layer.items():
            setting = lookup(key, where)
            values[key] = setting.parse(raw)
            source[key] = where
    return Settings(values, source)


def split_args(text: str | None, key: str) -> list[str]:
    """EXTRA / COMPILE_FLAGS → argv, split exactly once."""
    if not text:
        return []
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{key}={text!r} cannot be split into arguments: {exc}", hint="balance the quotes") from None

