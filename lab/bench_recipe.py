#!/usr/bin/env python3
"""The recipe as shipped against stock vLLM and NVIDIA's settings, at the full 48-layer real shape
with NVFP4 experts (issue 33): decode tok/s per stream, in blocks of whole servers.

Every flash server's argv and environment are the RunSpec `flash serve PROFILE K=V…` renders
(src/flash_cli/spec.py, the same call the gpu-e2e fleet makes), with only these substitutions,
each one recorded in the `booted` row (`deviations`):

- the model path: the bench's own directory (`prepare`), `model-hybrid/` for MODE=hybrid (the
  config `flash prepare hybrid` writes: side layers FP8_PB_WO), `model/` otherwise;
- `--load-format dummy` (random weights: no 125 GB download), `--host 127.0.0.1`, `--port`;
- `--gdn-prefill-backend triton` and `VLLM_USE_FLASHINFER_SAMPLER=0` (the device machine is offline:
  no FlashInfer cubins; the first touches prefill only, the second sampling, which greedy skips);
- `VLLM_PLE_MMAP_DIR` at the bench's table (patch 1 reads it instead of the model directory).

The reference servers:
- `stock`: the `published` profile's argv (checkpoint as published) with our plugin not loaded at
  all (`VLLM_PLUGINS=""`: no patch runs) and the PLE table on the GPU (`--engram-config
  {"cpu_offload":false}`): what a user gets from vLLM 0.33 with the recipe's serving flags;
- `nvidia`: NVIDIA's official one-Spark recipe (NVIDIA/local-ai-inference-recipes,
  models/qwen/qwen3.8-flash-next/dgx-spark/linux/vllm/nvfp4/recipe.yaml) on stock vLLM 0.33: the
  `nvidia` profile (profiles/nvidia.env: every flag and variable that our base takes) rendered
  as `stock` renders `published`; what only the B12x image has is named there (NVIDIA_DROPPED);
- `nvidia-flash`: the same profile as a flash server (our plugin, the table read from disk).

Two of these servers do not fit one H200 at once (the body is ~70 GiB), so whole servers
alternate in blocks: boot, an untimed warm-up at every cell, REPEATS rounds over the cells, stop;
configs in the order given, then reversed in the next cycle (A B B A: a drift over the session, the
GPU's clocks or a first block after a cold boot, falls on both sides of a pair), cycled until the
deadline; the server that ends one cycle is kept for the block that starts the next (a `kept` row).
A pair is one config's and stock's measurement of the same cell, round and cycle (the same prompts).

  prepare DIR [--ple-rows N] [--configs-only]   the 48-layer model dirs and the PLE table (bench_decode's writer)
  plan DIR [--configs …]       the servers as they would start, JSON
  run DIR --out RAW.jsonl …    the blocks (needs vLLM and a GPU)
  report RAW.jsonl… --out PNG [--json J]   pairs vs stock and vs nvidia, 95% intervals, a plot
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from lab.decode import client, model, recipe_report, schedule  # the shape, the client, the writer, the report

ROOT = Path(__file__).resolve().parents[1]

LAYERS = model.LAYERS
SHORT_PROMPT = 64
# past the QSA budget (indexer_budget 2,048 tokens = 512 blocks of 4): patch 8's top-k runs its
# selection only there, so the ablation without it means something only at this length
LONG_PROMPT = 6144

# name -> how it is rendered. kind: recipe (flash's RunSpec), stock (a profile's RunSpec without our
# plugin, table on the GPU: `published` = stock vLLM with the recipe's serving flags, `nvidia` =
# NVIDIA's one-Spark recipe on stock vLLM)
CONFIGS: dict[str, dict] = {
    "stock": {"kind": "stock", "profile": "published", "words": []},
    "default": {"kind": "recipe", "profile": "default", "words": []},
    "default-mtp4": {"kind": "recipe", "profile": "default", "words": ["MTP=4"]},
    "speed": {"kind": "recipe", "profile": "speed", "words": []},
    "shared": {"kind": "recipe", "profile": "shared", "words": []},  # long prefills chunked (bench_latency)
    "nvidia": {"kind": "stock", "profile": "nvidia", "words": []},
    "nvidia-flash": {"kind": "recipe", "profile": "nvidia", "words": []},
    "default-no10": {"kind": "recipe", "profile": "default", "words": ["DRAFT_VOCAB=0"]},
    "default-no8": {"kind": "recipe", "profile": "default", "words": ["DET_TOPK=0"]},
    # the c>=4 gap of run1 (benchmarks/recipe48-h200): the body's FP8 side layers (patch 6's
    # checkpoint) and the table read from the host (patch 1), each taken back to stock's
    "default-nvfp4": {"kind": "recipe", "profile": "default", "words": ["MODE=nvfp4"]},
    "default-ple-gpu": {"kind": "recipe", "profile": "default",
                        "words": ["CONTAINER_ENV=VLLM_PLE_MMAP=0", "EXTRA=--engram-config '{\"cpu_offload\":false}'"]},
    # MODE=hybrid renders VLLM_USE_DEEP_GEMM=0 (DeepGEMM's E8M0 path faults on the GB10's sm_121),
    # so on the H200 default's FP8 side layers run CUTLASS block-scaled GEMMs (its log); stock's side
    # layers are BF16 (no FP8 linear in its log). This asks whether DeepGEMM's FP8 kernels do better.
    # Its boot warm-up is skipped: run2's cold `relax` warm-up nvcc-compiled 1,371 kernels and missed
    # /health in 598 s. Skipped, DeepGEMM compiles the shapes a step meets lazily (graph capture, the
    # untimed warm-up round): the same kernels for the same M, so the timed rounds are unchanged.
    "default-deepgemm": {"kind": "recipe", "profile": "default",
                         "words": ["CONTAINER_ENV=VLLM_USE_DEEP_GEMM=1 VLLM_DEEP_GEMM_WARMUP=skip"]},
    # every prefill chunk's Mamba state kept (docs/PREFIX-CACHE.md): bench_latency's prefix study
    "default-dense": {"kind": "recipe", "profile": "default", "words": ["PREFIX_RETAIN=dense"]},
    # `shared`'s 800-token pieces outside and inside CUDA graphs (benchmarks/latency48-h100): run1's
    # `shared` captured up to 48 tokens (~140 ms a piece outside graphs); run2 measured `shared-graphs`
    # (up to 832: a piece plus 8 streams x 3 tokens) against it, and `shared` ships GRAPH_TOKENS=832
    # since. `shared-graphs` renders run2's argv (now the shipped one), `shared-nographs` run1's
    "shared-graphs": {"kind": "recipe", "profile": "shared", "words": ["GRAPH_TOKENS=832"]},
    "shared-nographs": {"kind": "recipe", "profile": "shared", "words": ["GRAPH_TOKENS=0"]},
    "shared-nomtp": {"kind": "recipe", "profile": "shared", "words": ["MTP=0"]},
    "shared-3200": {"kind": "recipe", "profile": "shared", "words": ["LONG_PREFILL=3200"]},
    # the piece-size sweep under graphs: a smaller piece is a shorter step beside the stream (issue 33's
    # p99 <= 2x idle) and more steps for the long prompt. Each divides the 1,600-token block, and its
    # GRAPH_TOKENS is the smallest capture size holding the piece plus 8 streams x 3 tokens
    "shared-100": {"kind": "recipe", "profile": "shared", "words": ["LONG_PREFILL=100", "GRAPH_TOKENS=128"]},
    "shared-200": {"kind": "recipe", "profile": "shared", "words": ["LONG_PREFILL=200", "GRAPH_TOKENS=224"]},
    "shared-400": {"kind": "recipe", "profile": "shared", "words": ["LONG_PREFILL=400", "GRAPH_TOKENS=432"]},
    # below run3's smallest piece: is F (lab/decode/pieces.py) paid by a piece of a few dozen tokens too?
    "shared-25": {"kind": "recipe", "profile": "shared", "words": ["LONG_PREFILL=25", "GRAPH_TOKENS=64"]},
}

# NVIDIA's one-Spark recipe is profiles/nvidia.env (its settings on our base): `nvidia` renders it
# as stock renders `published` (no plugin, table on the GPU), `nvidia-flash` as a flash server. What
# only the B12x image has is named there, one `# b12x: ITEM: why` line each (NVIDIA_DROPPED).
NVIDIA_PROFILE = ROOT / "profiles" / "nvidia.env"
def nvidia_dropped(path: Path = NVIDIA_PROFILE) -> dict[str, str]:
    """{recipe item: why it is left out} from the profile's `# b12x:` lines (flash_cli.profiles)."""
    from flash_cli.profiles import b12x_items

    out = b12x_items(path)
    if not out:
        raise SystemExit(f"{path}: no '# b12x: ITEM: why' lines (what NVIDIA's recipe has that our base does not)")
    return out


NVIDIA_DROPPED = nvidia_dropped()
OFFLINE_ARGS = ["--gdn-prefill-backend", "triton"]
OFFLINE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1"}


def _opt(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag`'s value replaced (or the pair appended when absent)."""
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def _spec(profile: str, words: list[str]):
    from flash_cli import recipe
    from flash_cli.commands import serve

    r = recipe.load([profile, *words], env={})
    return r, serve.plan(r, "<SNAPSHOT>")


def render(name: str, d: Path, port: int, python: str = "python3", sets: tuple[str, ...] = ()) -> dict:
    """One server as a plain process: {argv, env, deviations, settings}. `sets` (KEY=VALUE, run's
    --set) go after the config's own words, for every config alike, and are named as deviations."""
    c = CONFIGS[name]
    ple = {"VLLM_PLE_MMAP_DIR": str(d / "ple")}
    vllm = [python, "-m", "vllm.entrypoints.cli.main", "serve"]
    r, spec = _spec(c["profile"], [*c["words"], *sets])
    cmd = list(spec.command)
    if cmd[:2] != ["vllm", "serve"]:
        raise ValueError(f"{name}: the RunSpec's command starts {cmd[:2]}, not vllm serve")
    mdir = d / ("model-hybrid" if r.settings["MODE"] == "hybrid" else "model")
    args = cmd[3:]
    for flag, value in (("--load-format", "dummy"), ("--host", "127.0.0.1"), ("--port", str(port)),
                        ("--served-model-name", "bench")):
        args = _opt(args, flag, value)
    env = {k: v for k, v in spec.env.items() if k != "HF_HOME"} | OFFLINE_ENV | ple
    devs = [f"model {mdir.name}/ (MODE={r.settings['MODE']}), --load-format dummy, --host/--port, --served-model-name bench",
            "--gdn-prefill-backend triton, VLLM_USE_FLASHINFER_SAMPLER=0: offline (no FlashInfer cubins)"]
    devs += [f"{w}: set for every server of this run (--set)" for w in sets]
    if c["kind"] == "stock":
        argv = [*vllm, str(mdir), *args, "--engram-config", '{"cpu_offload":false}', *OFFLINE_ARGS]
        env["VLLM_PLUGINS"] = ""
        devs += ["VLLM_PLUGINS='': flash's plugin not loaded (no patch)",
                 "--engram-config {\"cpu_offload\":false}: the table on the GPU"]
        if c["profile"] == "nvidia":
            devs += [f"dropped {w}: {why}" for w, why in NVIDIA_DROPPED.items()]
            devs.append("checkpoint: the published nvidia layout (the recipe's local-inference-lab QAD export is not here)")
    else:
        argv = [python, "-m", "flash_vllm.launch", *vllm, str(mdir), *args, *OFFLINE_ARGS]
        devs.append(f"VLLM_PLE_MMAP_DIR={ple['VLLM_PLE_MMAP_DIR']}: the bench's table")
    return {"name": name, "words": [c["profile"], *c["words"], *sets], "argv": argv, "env": env, "deviations": devs,
            "settings": {k: str(r.settings[k]) for k in ("MODE", "MTP", "CTX", "GPU_MEM", "KV_DTYPE", "DET_TOPK",
                                                          "DRAFT_VOCAB", "PLE_MODE")}}


# --- prepare ---------------------------------------------------------------------------------------

def side_modules(layers: int) -> list[str]:
    """The side-layer linears `flash prepare hybrid` converts (checkpoint.layout.SIDE_LAYER)."""
    out = []
    for i in range(layers):
        p = f"{model.P}layers.{i}."
        if model.is_qsa(i):
            out += [p + f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "indexer.index_qk_proj")]
        else:
            out += [p + f"linear_attn.{m}" for m in ("in_proj_qkv", "in_proj_z", "out_proj")]
        out += [p + f"mlp.shared_expert.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
    return out


def write_hybrid(d: Path, layers: int) -> dict:
    """model-hybrid/: model/'s files, the configs edited as `flash prepare hybrid` edits them."""
    from flash_cli.checkpoint import layout, quantcfg

    src, dst = d / "model", d / "model-hybrid"
    modules = side_modules(layers)
    bad = [m for m in modules if not layout.SIDE_LAYER.fullmatch(m + ".weight")]
    if bad:
        raise SystemExit(f"not side layers by flash's own rule: {bad[:3]}")
    cfg = json.loads((src / "config.json").read_text())
    hq = json.loads((src / "hf_quant_config.json").read_text())
    summary = quantcfg.edit(cfg, hq, modules, [f"{model.P}layers.{i}.mlp.experts" for i in range(layers)])
    problems = quantcfg.problems(cfg, hq, modules)
    if problems:
        raise SystemExit(f"the hybrid config fails flash's own gate: {problems[:3]}")
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        target = dst / f.name
        if f.name in ("config.json", "hf_quant_config.json") or target.exists():
            continue
        target.symlink_to(f.resolve())
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "hf_quant_config.json").write_text(json.dumps(hq, indent=1))
    return summary


def prepare(args) -> int:
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)  # bench_decode's disk check reads the parent
    layers = model.check_layers(args.layers)
    rc = model.prepare(argparse.Namespace(dir=str(d), quant="nvfp4", ple_rows=args.ple_rows, layers=layers,
                                          configs_only=args.configs_only))
    if rc:
        return rc
    summary = write_hybrid(d, layers)
    print(json.dumps({"hybrid": summary | {"excludes_dropped": len(summary["excludes_dropped"])}}))
    return 0


def plan_cmd(args) -> int:
    d = Path(args.dir).resolve()
    print(json.dumps([render(c, d, args.port + i, args.python) for i, c in enumerate(_configs(args.configs))], indent=1))
    return 0


# --- run -------------------------------------------------------------------------------------------

def _configs(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names or len(set(names)) < len(names):
        raise SystemExit(f"--configs {text!r}: give a comma-separated subset of {', '.join(CONFIGS)}, each once")
    return names


def cells(levels: list[int], long_levels: list[int], long_prompt: int) -> list[tuple[int, int]]:
    """(concurrency, prompt tokens) measured in every round, short prompts first."""
    return [(c, SHORT_PROMPT) for c in levels] + [(c, long_prompt) for c in long_levels]


def _gpu_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def _log_facts(log: Path) -> dict:
    """What the boot log says about the kernels that ran and the KV pool (as printed)."""
    facts: dict = {}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return facts
    keys = ("MoE backend", "moe backend", "Using ", "KV cache", "maximum concurrency", "flash_vllm", "applied [")
    lines = [ln.strip()[-300:] for ln in text.splitlines() if any(k in ln for k in keys)]
    facts["log_lines"] = lines[:40]
    return facts


class Server:
    def __init__(self, spec: dict, log: Path):
        self.spec, self.log = spec, log
        self.port = int(spec["argv"][spec["argv"].index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        fh = schedule.open_server_log(self.log, self.spec, "a")
        self.proc = subprocess.Popen(self.spec["argv"], env={**os.environ, **self.spec["env"]}, stdout=fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float) -> str | None:
        """None once /health answers 200; else why not (exited, timed out)."""
        import requests

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return f"exited {self.proc.returncode}"
            try:
                if requests.get(self.url + "/health", timeout=3).status_code == 200:
                    return None
            except requests.RequestException:
                pass
            time.sleep(2)
        return f"no /health after {timeout:.0f} s"

    def boot_row(self, timeout: float) -> dict:
        """Wait for /health: the `booted` row (what ran, as rendered, and what its log says) or the
        `boot_failed` one with the log's tail; the caller adds the label and its own fields."""
        why = self.wait(timeout)
        if why:
            return {"event": "boot_failed", "why": why, "tail": self.log.read_text(errors="replace")[-2000:]}
        spec = self.spec
        return {"event": "booted", "boot_s": round(time.monotonic() - self.started, 1), "gpu_mib": _gpu_mib(),
                "words": spec["words"], "log": self.log.name, "argv": spec["argv"], "env": spec["env"],
                "deviations": spec["deviations"], "settings": spec["settings"], **_log_facts(self.log)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@contextlib.contextmanager
def exit_on_term():
    """Inside it SIGTERM raises SystemExit, so a bench stopped by `timeout` (gpu_session's phases)
    still runs its `finally` and stops the server it started: Python's default dies at once, and the
    server, in a session of its own, would hold the GPU for every phase after it."""
    old = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def serving(spec: dict, log: Path, timeout: float, sink):
    """One server for a block: started, its `booted` (or `boot_failed`) row given to `sink`, yielded
    when booted (None when not), stopped on the way out (an exception, exit_on_term's SIGTERM)."""
    srv = Server(spec, log)
    srv.start()
    try:
        row = srv.boot_row(timeout)
        sink(row)
        yield srv if row["event"] == "booted" else None
    finally:
        srv.stop()


def render_all(names: list[str], d: Path, port: int, sets: list[str]) -> dict[str, dict]:
    """Every server of a run rendered once, up front (`--set` for all alike): a bad value fails here,
    before the first boot, with the settings parser's message."""
    return {name: render(name, d, port, sys.executable, tuple(sets)) for name in names}


def add_set_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe setting for every server of the run (e.g. GPU_MEM=0.95 at 32 layers on an H100), "
                        "recorded in each booted row's deviations")


def row_base(meta: dict) -> dict:
    """What every raw row names: the model dirs' shape (prepare's meta.json), the commit measured, the GPU."""
    from flash_cli.plan.hardware import query_gpus  # the planner's nvidia-smi reader

    gpus = query_gpus()
    return {"layers": meta.get("layers", LAYERS), "quant": meta.get("quant"), "ple_rows": meta.get("ple_rows"),
            "commit": schedule.tree_measured(), "gpu": gpus[0][0] if gpus else None}


def boot_estimate(boots: list[tuple[str, float]], name: str, guess: float) -> float:
    """How long `name`'s next boot will take, from this session's boots so far (in order).

    A config's own last boot, except the session's first boot: that one compiled the JIT kernels
    and wrote the compile caches every later boot reads (stock 396 s cold, then ~110-150 s a boot on
    the H200, 2026-12-06 run5), so its config's next boot is estimated by the slowest later boot.
    Taking the cold figure skipped stock's second block with 198 s left (needing 458)."""
    own = [s for n, s in boots if n == name]
    if not own:
        return guess
    later = [s for _, s in boots[1:]]
    if boots[0][0] == name and len(own) == 1 and later:
        return max(later)
    return own[-1]


def reference(configs: list[str]) -> str | None:
    """The config the report pairs the others with (recipe_report: stock, else default)."""
    return next((c for c in ("stock", "default") if c in configs), None)


def next_block(todo: list[str], need: dict[str, float], left: float, ref: str | None, kept: str | None = None) -> str:
    """The config whose block runs next in a cycle: the cycle's own order, unless the rest of the
    cycle does not fit in the time left. Then the reference's block comes before any that needs a
    boot, since a block pairs with nothing without the reference's block of the same cycle (run5
    and run8 each lost stock's last block, and with it every pair of their second cycle); a server
    kept from the last cycle still goes first when the reference fits after it (its block needs no
    boot)."""
    if ref not in todo or todo[0] == ref or sum(need[n] for n in todo) <= left:
        return todo[0]
    if todo[0] == kept and need[kept] + need[ref] <= left:
        return kept
    return ref


def run(args) -> int:
    d = Path(args.dir).resolve()
    meta = json.loads((d / "meta.json").read_text())
    configs = _configs(args.configs)
    grid = cells(client.parse_levels(args.levels), client.parse_levels(args.long_levels) if args.long_levels else [], args.long_prompt)
    sink = client.jsonl_sink(args.out)
    logs = Path(args.logs or Path(args.out).parent)
    logs.mkdir(parents=True, exist_ok=True)
    specs = render_all(configs, d, args.port, args.set)
    base = row_base(meta) | {"design": "blocks"}
    t0 = time.monotonic()
    deadline = t0 + args.deadline
    boots: list[tuple[str, float]] = []  # every boot in order: the first paid the session's cold caches
    block_s: list[float] = []

    def left() -> float:
        return deadline - time.monotonic()

    def emit(row: dict) -> None:
        sink(row)
        print(json.dumps(row)[:600], flush=True)

    # A B B A puts the same config at the end of one cycle and the start of the next: that server is
    # kept for the second block (a `kept` row instead of a `booted` one), one boot fewer per cycle
    held: Server | None = None
    cycle, ref = 0, reference(configs)

    def need_s(name: str) -> float:
        kept = held is not None and held.spec["name"] == name
        return (0 if kept else boot_estimate(boots, name, args.boot_guess)) + (max(block_s) if block_s else args.block_guess)

    try:
        while left() > 0 and (not args.cycles or cycle < args.cycles):
            ran = 0
            todo = list(configs if cycle % 2 == 0 else configs[::-1])
            while todo:
                needs = {n: need_s(n) for n in todo}
                name = next_block(todo, needs, left(), ref, held.spec["name"] if held is not None else None)
                if name != todo[0]:
                    emit({"event": "reordered", "label": name, "cycle": cycle, "left_s": round(left()),
                          "need_s": round(sum(needs.values())), "order": [name] + [n for n in todo if n != name], **base})
                todo.remove(name)
                kept = held is not None and held.spec["name"] == name
                need = need_s(name)
                if left() < need:
                    emit({"event": "skipped", "label": name, "cycle": cycle, "left_s": round(left()), "need_s": round(need), **base})
                    continue
                if kept:
                    srv = held
                    emit({"event": "kept", "label": name, "cycle": cycle, "log": srv.log.name, **base})
                else:
                    if held is not None:
                        held.stop()
                    srv = held = Server(specs[name], logs / f"{name}-c{cycle}.log")
                    srv.start()
                    row = srv.boot_row(min(args.boot_timeout, left()))
                    emit({**row, "label": name, "cycle": cycle, **base})
                    if row["event"] != "booted":
                        srv.stop()
                        held = None
                        continue
                    boots.append((name, row["boot_s"]))
                k0 = time.monotonic()
                settle = client.PLE_SETTLE_S if CONFIGS[name]["kind"] == "recipe" else 0.0
                extra = {**base, "cycle": cycle}
                for conc, plen in grid:  # the first batch of each shape pays one-time costs: untimed
                    client.warm(srv.url, name, conc, args.warmup_tokens, sink, extra | {"prompt_tokens": plen}, settle, plen)
                # each config sees the same prompts in the same order within a cycle
                rng = random.Random(1000 + cycle)
                for rep in range(args.repeats):
                    turn = rep % len(grid)
                    for conc, plen in grid[turn:] + grid[:turn]:
                        if left() < 5:
                            break
                        client.measure_one(srv.url, name, conc, args.tokens, cycle * args.repeats + rep, rng, sink,
                                           extra | {"prompt_tokens": plen, "round": rep}, settle, plen)
                block_s.append(time.monotonic() - k0)
                ran += 1
            if not ran:
                break
            cycle += 1
    finally:
        if held is not None:
            held.stop()
    emit({"event": "end", "at_s": round(time.monotonic() - t0, 1), "cycles": cycle, "boot_s": dict(boots), **base})
    return 0


# --- report (lab/decode/recipe_report.py) ---------------------------------------------------------

def report_cmd(args) -> int:
    rows = recipe_report.load_rows(args.files)
    rep = recipe_report.report(rows)
    print(json.dumps(rep, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
    recipe_report.plot(rep, rows, list(CONFIGS), args.out)
    print(f"wrote {args.out}")
    return 0


def gb10_cmd(args) -> int:
    print(json.dumps(recipe_report.gb10_bands(args.reports, args.bandwidth_gbs), indent=2))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir")
    p.add_argument("--ple-rows", default="32000000", help="'full' (320,001,536 rows, 47.68 GiB) or a row count")
    p.add_argument("--layers", type=int, default=LAYERS,
                   help="the real model's %(default)s; fewer (a multiple of 4) keep every per-layer shape, for a GPU "
                        "that cannot hold 48 (an 80 GB H100 ran 32 with --set GPU_MEM=0.95: recipe48-h200 run3)")
    p.add_argument("--configs-only", action="store_true",
                   help="write the configs and no PLE table: enough for `flash plan --config` (lab.plan_vs_boots)")
    p.set_defaults(func=prepare)
    p = sub.add_parser("configs", help="the servers --configs accepts; with a list, check it (exit 2 naming the bad one)")
    p.add_argument("list", nargs="?")
    p.set_defaults(func=lambda a: print(",".join(_configs(a.list) if a.list else CONFIGS)) or 0)
    p = sub.add_parser("plan")
    p.add_argument("dir")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--port", type=int, default=18700)
    p.add_argument("--python", default="python3")
    p.set_defaults(func=plan_cmd)
    p = sub.add_parser("run")
    p.add_argument("dir")
    p.add_argument("--configs", default="stock,default,nvidia")
    p.add_argument("--out", required=True)
    p.add_argument("--logs")
    p.add_argument("--port", type=int, default=18700)
    p.add_argument("--levels", default="1,4,8,16")
    p.add_argument("--long-levels", default="1,4", help="concurrencies measured with --long-prompt ('' for none)")
    p.add_argument("--long-prompt", type=int, default=LONG_PROMPT)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="rounds over the cells per block")
    p.add_argument("--warmup-tokens", type=int, default=32)
    p.add_argument("--boot-timeout", type=float, default=900)
    p.add_argument("--boot-guess", type=float, default=300, help="s a first boot is assumed to take")
    p.add_argument("--block-guess", type=float, default=120, help="s a block is assumed to take before one ran")
    p.add_argument("--deadline", type=float, default=1500)
    p.add_argument("--cycles", type=int, default=0, help="stop after this many cycles (0: cycle until the deadline)")
    add_set_option(p)
    p.set_defaults(func=run)
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--json")
    p.set_defaults(func=report_cmd)
    p = sub.add_parser("gb10", help="the GB10 decode-step band from the measured default c=1 steps of report JSONs")
    p.add_argument("reports", nargs="+")
    p.add_argument("--bandwidth-gbs", type=float, default=recipe_report.H200_BANDWIDTH_GBS,
                   help="the H200's measured copy bandwidth (decode-h200 run5/run6)")
    p.set_defaults(func=gb10_cmd)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
