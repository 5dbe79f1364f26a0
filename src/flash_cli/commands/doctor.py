"""`flash doctor [PROFILE] [K=V…] [--json]`: host, Docker, image, weights and the profile itself.

Exit 1 when anything would make `setup` or `serve` fail; warnings never block.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
from pathlib import Path

from .. import hfcache, preflight, recipe
from ..errors import ConfigError
from ..output import Report, print_json, say
from ..spec import NATIVE_CTX, default_image, is_loopback
from . import summary

GIB = 1024**3
SPARK_MEM_GIB = 115  # a Spark reports ~119 GiB; anything well below cannot hold the recipe
DOWNLOAD_GB = 140  # the checkpoint (124-135 GB) plus headroom
VARIANT_GB = 15  # fp8 side-layer shards written next to the snapshot
BF16_KV_CEILING = 500_000  # validated bf16-KV context; 1M needs fp8 KV
PROC = "/proc"  # tests point this at synthetic files


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help=summary("doctor"))
    recipe.add_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def check_host(s, rep: Report) -> None:
    rep.step("host")
    sec = "host"
    arch = platform.machine()
    (rep.ok if arch in ("aarch64", "arm64") else rep.warn)(
        f"architecture {arch}" + ("" if arch in ("aarch64", "arm64") else ": the recipe targets the DGX Spark (aarch64); untested here"), sec)
    from ..plan import hardware  # the planner's host readers: one implementation

    mem = hardware.read_meminfo(f"{PROC}/meminfo")
    total, avail = mem.get("MemTotal", 0), mem.get("MemAvailable", 0)
    if total >= SPARK_MEM_GIB * GIB:
        rep.ok(f"memory {total / GIB:.0f} GiB", sec)
    else:
        rep.fail(f"memory {total / GIB:.0f} GiB: the recipe needs the Spark's 128 GB pool", sec)
    # vLLM budgets GPU_MEM × the device total cudaMemGetInfo reports, which on a Spark's unified
    # memory is larger than MemTotal (121.69 vs 119.68 GiB): use the larger of the two.
    device_total = hardware.PRESETS["gb10"].device_total if arch in ("aarch64", "arm64") else 0
    need = max(total, device_total) * s["GPU_MEM"]
    if avail >= need:
        rep.ok(f"{avail / GIB:.0f} GiB available (GPU_MEM={s['GPU_MEM']:.2f} needs {need / GIB:.0f} GiB free to boot)", sec)
    else:
        rep.fail(f"only {avail / GIB:.0f} GiB available; GPU_MEM={s['GPU_MEM']:.2f} needs {need / GIB:.0f} GiB: "
                 "stop other programs or lower GPU_MEM", sec)
    from .. import mempressure

    for level, text in mempressure.findings(mempressure.read(PROC), warn_pct=s["MEM_PRESSURE_WARN"]):
        if not (level == "info" and text.startswith("MemAvailable")):  # said above, against the plan
            getattr(rep, level)(text, sec)
    rows = hardware.query_gpus()
    gpus = None if rows is None else [r[0] for r in rows]
    # a recipe that asks for the GPU (GPUS=all) cannot serve without one: a problem, not a warning
    missing = rep.fail if s["GPUS"] == "all" else rep.warn
    needs = ": the recipe's GPUS=all cannot start" if s["GPUS"] == "all" else ""
    if gpus is None:
        missing(f"nvidia-smi not found: no NVIDIA driver visible{needs}", sec)
    elif not gpus:
        missing(f"nvidia-smi lists no GPU{needs}", sec)
    elif any("GB10" in g for g in gpus):
        rep.ok(f"GPU {gpus[0]}", sec)
    else:
        rep.warn(f"GPU {gpus[0]}: the patches are built and measured for GB10 (sm_121)", sec)


def check_docker(s, rep: Report):
    from .. import engine
    from ..errors import DockerUnavailable

    rep.step("docker")
    sec = "docker"
    try:
        client = engine.connect(timeout=10)
    except DockerUnavailable as exc:
        rep.fail(f"{exc} ({exc.hint})", sec)
        return None
    info = client.info()
    rep.ok(f"Docker Engine {info.get('ServerVersion', '?')}", sec)
    runtimes = info.get("Runtimes") or {}
    cdi = any(Path(d).glob("*nvidia*") for d in ("/etc/cdi", "/var/run/cdi") if Path(d).is_dir())
    if "nvidia" in runtimes or shutil.which("nvidia-ctk") or shutil.which("nvidia-container-runtime") or cdi:
        rep.ok("NVIDIA container toolkit", sec)
    elif s["GPUS"] == "all":
        rep.fail("NVIDIA container toolkit not found: GPUS=all will fail to start (install nvidia-container-toolkit)", sec)
    others = [c.name for c in client.containers.list() if c.name != s["NAME"]]
    if others:
        rep.warn(f"other running containers: {', '.join(others[:5])} (one big model at a time)", sec)
    ours = engine.find(client, s["NAME"])
    held = ours is not None and engine.state(ours).status == "running"
    problems = preflight.port(s, held_by_us=held)
    if held:
        rep.info(f"port {s['BIND']}:{s['PORT']} is held by {s['NAME']} itself", sec)
    elif problems:
        rep.fail(f"{problems[0].message}: {problems[0].hint}", sec)
    else:
        rep.ok(f"port {s['BIND']}:{s['PORT']} is free", sec)
    return client


def check_image(s, client, rep: Report) -> None:
    from .. import engine

    rep.step("image")
    image = s["IMAGE"] or default_image(s["BASE"])
    if client is None:
        rep.warn(f"image {image}: not checked (no Docker)", "image")
        return
    labels = engine.image_labels(client, image)
    if labels is None:
        rep.info(f"image {image} is not built yet: flash setup builds it", "image")
        return
    problems = preflight.image(s, image, labels)
    if problems:
        rep.warn(f"{problems[0].message}: {problems[0].hint}", "image")
    else:
        rep.ok(f"image {image} (base {s['BASE']}, patch set {labels.get('org.flash.patchset', '?')})", "image")


def check_weights(r: recipe.Recipe, rep: Report) -> None:
    rep.step(f"weights ({r.settings['MODEL']} in {r.hf_cache})")
    sec, s = "weights", r.settings
    cache = r.hf_cache
    probe = cache if cache.exists() else cache.parent
    if probe.exists() and not os.access(probe, os.W_OK):
        rep.warn(f"{probe} is not writable (owner uid {probe.stat().st_uid}): sudo chown -R $USER {probe}", sec)
    free = shutil.disk_usage(probe if probe.exists() else Path("/")).free / 1e9
    snapshot = r.snapshot()
    if snapshot is None:
        rep.info("not downloaded yet (~135 GB)", sec)
        (rep.ok if free >= DOWNLOAD_GB else rep.fail)(f"{free:.0f} GB free (download + variant need ~{DOWNLOAD_GB} GB)", sec)
    else:
        problems = preflight.weights(s, cache, snapshot)
        if not problems:
            ready = hfcache.variant_dir(snapshot, s["MODE"])
            rep.ok(f"{ready}", sec)
        for p in problems:
            if p.error.__name__ == "WeightsMissing" and s["MODE"] != "nvfp4" and "layout" in p.message:
                rep.info(f"{p.message}: {p.hint}", sec)
                if free < VARIANT_GB:
                    rep.fail(f"only {free:.0f} GB free; the {s['MODE']} layout needs ~{VARIANT_GB} GB", sec)
            else:
                (rep.warn if p.error.__name__ == "WeightsMissing" else rep.fail)(f"{p.message}: {p.hint}", sec)
    if os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or (cache / "token").exists():
        rep.ok("Hugging Face token available", sec)
    else:
        rep.info("no HF_TOKEN: downloads may be rate-limited", sec)


def check_profile(r: recipe.Recipe, rep: Report) -> None:
    rep.step("profile")
    sec, s = "profile", r.settings
    before = rep.failures + rep.warnings
    if not s["YARN"] and s["CTX"] > NATIVE_CTX:
        rep.fail(f"CTX={s['CTX']} needs YARN=1 (native context is {NATIVE_CTX})", sec)
    if s["KV_DTYPE"] in ("auto", "bfloat16") and s["CTX"] > BF16_KV_CEILING:
        rep.warn(f"CTX={s['CTX']} with {s['KV_DTYPE']} KV is above the validated {BF16_KV_CEILING}; 1M needs KV_DTYPE=fp8_e4m3", sec)
    from .serve import PLACEHOLDER, plan

    try:
        problems = preflight.recipe(plan(r, PLACEHOLDER))  # checked on the RunSpec serve would run
    except ConfigError as exc:  # a value build() refuses (e.g. a speculative config the base lacks)
        problems = [preflight.Problem(ConfigError, str(exc), exc.hint or "")]
    for p in problems:
        rep.fail(f"{p.message}: {p.hint}", sec)
    if not is_loopback(s["BIND"]) and s["API_KEY"] == "off":
        rep.warn(f"BIND={s['BIND']} with API_KEY=off: the API is open to the network without a key", sec)
    if s["PAD_M4"]:
        rep.warn("PAD_M4=1 has no effect (upstream in every supported release)", sec)
    from ..spec import inapplicable

    for text in inapplicable(s):  # set, but the chosen PARALLEL layout never reads it
        rep.warn(text, sec)
    try:
        from ..plan import doctor_findings  # the memory planner, when present
    except ImportError:
        doctor_findings = None
    if doctor_findings is not None:
        for level, text in doctor_findings(s):
            getattr(rep, level)(text, sec)
    if rep.failures + rep.warnings == before:
        rep.ok("profile looks fine", sec)


def check_deployment(r: recipe.Recipe, rep: Report) -> list[dict]:
    """Every box of a PARALLEL deployment, through its own engine (nodecheck.py)."""
    from .. import nodecheck, state
    from ..multinode import build_deployment

    s = r.settings
    dep = build_deployment(s, profile=r.profile.name, snapshot="<SNAPSHOT>", hf_cache=str(r.hf_cache),
                           state_dir=str(state.state_dir()))
    rep.step(f"deployment ({dep.parallel} on {s['NODES']})")
    found = [nodecheck.facts(n, s, n.spec.image) for n in dep.nodes]
    for level, text in nodecheck.judge(found, s):
        getattr(rep, level)(text, "deployment")
    return found


def run(args: argparse.Namespace) -> int:
    r = recipe.load(args.recipe)
    s = r.settings
    rep = Report(quiet=args.json)
    if not args.json:
        print(f"doctor: profile '{r.profile.name}' (image {s['IMAGE'] or default_image(s['BASE'])}, mode {s['MODE']}, "
              f"container {s['NAME']} on {s['BIND']}:{s['PORT']})")
    boxes = None
    if s["PARALLEL"] != "none":  # the boxes are checked through their engines, not this machine's
        boxes = check_deployment(r, rep)
    else:
        check_host(s, rep)
        client = check_docker(s, rep)
        check_image(s, client, rep)
        check_weights(r, rep)
    check_profile(r, rep)
    if args.json:
        print_json({"profile": r.profile.name, "failures": rep.failures, "warnings": rep.warnings,
                    "checks": rep.items, **({"boxes": boxes} if boxes is not None else {})})
    elif rep.failures:
        say(f"\n{rep.failures} problem(s) to fix before flash setup / serve.")
    elif rep.warnings:
        say(f"\n{rep.warnings} warning(s); nothing blocking.")
    else:
        say("\nall good.")
    return 1 if rep.failures else 0
