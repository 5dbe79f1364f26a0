"""`flash serve|up [PROFILE] [K=V…] [--dry-run]`: preconditions, then one container from the RunSpec."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from .. import preflight, recipe, running, state
from ..errors import ContainerDied, UsageError
from ..output import dim, say
from ..render import docker_run_text
from ..spec import LABEL, RunSpec, build
from . import summary

PLACEHOLDER = "<SNAPSHOT>"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", aliases=["up"], help=summary("serve"),
                       description="Start the vLLM server container for PROFILE (default: default). "
                       "KEY=VALUE words override the profile (see docs/SETTINGS.md).")
    recipe.add_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="print the exact docker run line; run nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: the run spec as JSON")
    p.add_argument("--force", action="store_true",
                   help="replace the container even when it already runs this exact recipe")
    p.add_argument("--no-profile", action="store_true",
                   help="defaults + environment only (what scripts/serve.sh uses)")
    p.add_argument("--start-check", type=float, default=8.0, metavar="S",
                   help="seconds to watch for an early death (default 8)")
    p.set_defaults(func=run)


def plan(r: recipe.Recipe, snapshot_name: str) -> RunSpec:
    return build(r.settings, profile=r.profile.name, snapshot=snapshot_name, hf_cache=str(r.hf_cache),
                 state_dir=str(state.state_dir()))


def kv_plan_label(settings) -> str:
    """The planner's KV prediction for this boot, stored on the container so `flash status` can
    compare it with the boot log without re-planning (and importing the planner) on every call."""
    from ..kvline import prediction_label
    from ..plan import prediction

    try:
        return prediction_label(*prediction(settings))
    except Exception as exc:  # noqa: BLE001 - a planner problem must not stop a serve
        return json.dumps({"error": str(exc)})


def deployment_text(dep) -> str:
    """Every box's `docker run` line, head first, each under a comment naming box and engine."""
    out = []
    for n in dep.nodes:
        where = n.engine or "this machine's Docker Engine"
        out.append(f"# node {n.index} ({n.role}) on {n.box} [{where}], fast link {n.addr}"
                   + ("" if n.serves_api else ", no API (headless)"))
        out.append(docker_run_text(n.spec))
    if dep.router is not None:
        r = dep.router
        where = r.engine or "this machine's Docker Engine"
        out.append(f"# router on {r.box} [{where}]: the deployment's one endpoint "
                   f"{r.spec.api_url}/v1, in front of the prefill and decode servers")
        out.append(docker_run_text(r.spec))
    return "\n".join(out)


def deployment_json(dep, hf_cache: str) -> dict:
    return {"name": dep.name, "parallel": dep.parallel, "api": dep.api_urls(), "warnings": dep.warnings,
            "nodes": [{"node": n.index, "box": n.box, "engine": n.engine, "addr": n.addr, "role": n.role,
                       "serves_api": n.serves_api, "gpus": n.gpus, "plain": n.plain(hf_cache), "spec": asdict(n.spec)}
                      for n in dep.nodes],
            "router": None if dep.router is None else {"box": dep.router.box, "engine": dep.router.engine,
                                                       "url": dep.router.spec.api_url, "spec": asdict(dep.router.spec)}}


def present(args: argparse.Namespace, r: recipe.Recipe, snapshot, spec: RunSpec, summary: str, warnings, as_json,
            as_text) -> bool:
    """What one box and a deployment share: the header, the warnings, the recipe's problems (checked
    on `spec`, the head's RunSpec for a deployment). On --dry-run print the problems and the plan
    (JSON or docker lines) and return True; otherwise raise the first problem, or return False to go on."""
    s = r.settings
    problems = preflight.recipe(spec) + preflight.weights(s, r.hf_cache, snapshot)
    say(f"serve: profile '{r.profile.name}': {r.profile.desc}")
    say(dim(f"  {summary}"))
    for w in warnings:
        say(f"  ! {w}")
    if not args.dry_run:
        for p in problems:
            p.raise_()
        return False
    for p in problems:
        say(f"  ! would refuse: {p.message} ({p.hint})")
    print(json.dumps(as_json(), indent=2) if args.json else as_text())
    return True


def run_deployment(args: argparse.Namespace, r: recipe.Recipe, snapshot) -> int:
    from ..multinode import build_deployment

    s = r.settings
    dep = build_deployment(s, profile=r.profile.name, snapshot=snapshot.name if snapshot else PLACEHOLDER,
                           hf_cache=str(r.hf_cache), state_dir=str(state.state_dir()))
    summary = (f"PARALLEL={dep.parallel} NODES={s['NODES']} NODE_ADDRS={s['NODE_ADDRS']} MODE={s['MODE']} "
               f"BASE={s['BASE']} IMAGE={dep.head.spec.image} NAME={s['NAME']} API {', '.join(dep.api_urls())}")
    if present(args, r, snapshot, dep.head.spec, summary, dep.warnings,
               lambda: deployment_json(dep, str(r.hf_cache)), lambda: deployment_text(dep)):
        return 0
    from .. import deploy

    return deploy.serve(dep, s, force=args.force, start_check=args.start_check,
                        kv_label=kv_plan_label(s))


def run(args: argparse.Namespace) -> int:
    r = recipe.load(args.recipe, use_profile=not args.no_profile)
    s = r.settings
    snapshot = r.snapshot()
    if s["PARALLEL"] != "none":
        return run_deployment(args, r, snapshot)
    spec = plan(r, snapshot.name if snapshot else PLACEHOLDER)
    summary = (f"MODE={s['MODE']} BASE={s['BASE']} IMAGE={spec.image} NAME={s['NAME']} {s['BIND']}:{s['PORT']} "
               f"CTX={s['CTX']} YARN={int(s['YARN'])} MTP={s['MTP']} GPU_MEM={s['GPU_MEM']:.2f} KV_DTYPE={s['KV_DTYPE']}")
    if present(args, r, snapshot, spec, summary, spec.warnings, lambda: asdict(spec), lambda: docker_run_text(spec)):
        return 0
    from .. import engine

    client = engine.connect()
    for p in preflight.image(s, spec.image, engine.image_labels(client, spec.image)):
        p.raise_()
    existing = engine.find(client, s["NAME"])
    if existing is not None and existing.labels.get(f"{LABEL}.nodes"):
        raise UsageError(f"{s['NAME']} is a {existing.labels.get(f'{LABEL}.parallel', 'multi-node')} deployment on "
                         f"{existing.labels[f'{LABEL}.nodes']}; a one-box server would replace only part of it",
                         hint="flash rm (removes every box) first, or pick another NAME=")
    held = existing is not None and engine.state(existing).status == "running"
    for p in preflight.port(s, held_by_us=held):
        p.raise_()
    if existing is not None:
        same = existing.labels.get(f"{LABEL}.settings") == spec.labels[f"{LABEL}.settings"] \
            and existing.labels.get(f"{LABEL}.image") == spec.image and existing.image.id == client.images.get(spec.image).id
        if held and same and not args.force:
            print(f"{s['NAME']} already runs this recipe (settings {spec.labels[f'{LABEL}.settings']}); nothing to do "
                  "(--force replaces it: a full reboot)")
            return 0
        if held:
            from ..running import drain

            left, _ = drain(running.endpoint(existing), s["DRAIN_TIMEOUT"])
            if left:
                say(f"  ! {left:.0f} request(s) still running after {s['DRAIN_TIMEOUT']} s; replacing anyway")
        say(f"  · replacing the existing container {engine.describe(existing)}")
        existing.remove(force=True)

    if spec.needs_api_key:
        path, created = state.ensure_api_key(s["NAME"])
        say(f"  · API key {'generated' if created else 'kept'}: {path} (mode 0600; flash status shows it)")
    if s["LOG_REQUESTS"]:
        state.ensure_logging_config()
    for m in spec.mounts:  # bind-mounted compile caches must exist or Docker creates them root-owned
        if m.kind == "bind" and m.target.startswith("/root/"):
            os.makedirs(m.source, exist_ok=True)

    spec.labels[f"{LABEL}.kv-plan"] = kv_plan_label(s)
    container = engine.create_and_start(client, spec)
    st = engine.watch_start(container, args.start_check)
    if st.status != "running":
        lines = engine.tail(container, 25)
        container.remove(force=True)
        print("\n".join(lines), file=sys.stderr)
        raise ContainerDied(
            f"{spec.name} died during start (exit code {st.exit_code}{', OOM-killed' if st.oom_killed else ''}); "
            "its last log lines are above; the container was removed",
            hint="a bad flag in EXTRA, a missing image feature, or memory? see: flash doctor")
    print(f">> {spec.name} starting: {spec.api_url}/v1 (profile {r.profile.name}, image {spec.image})")
    say("   boots take 8-13 minutes on a Spark. next: flash wait, then flash test")
    return 0

