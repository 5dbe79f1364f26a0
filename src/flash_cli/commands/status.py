"""`flash status [--json]`: container, API, KV pool, patches, requests, prefix-cache hit rate, MTP
acceptance length and its rates by draft position."""

from __future__ import annotations

import argparse
import re
import time

from .. import api, recipe, running
from ..output import Report, print_json
from ..gates.spec_decode import SPEC_ACCEPTED, SPEC_DRAFTS, SPEC_PER_POS, acceptance_length, positions
from ..spec import LABEL
from . import summary

KV_LINE = re.compile(r"GPU KV cache size")
PATCH_LINE = re.compile(r"flash_vllm|PLE mmap|mamba_block_size|draft vocabulary|fp8 hybrid|deterministic top-k")
METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
           SPEC_DRAFTS, SPEC_ACCEPTED)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help=summary("status"))
    recipe.add_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def plan_comparison(labels: dict, kv_line: str | None) -> str | None:
    """The planner's prediction for the recipe the container was started with, next to the log:
    from the label `flash serve` wrote; containers from older versions are re-planned."""
    from ..kvline import compare, parse_prediction

    stored = labels.get(f"{LABEL}.kv-plan")
    if stored:
        try:
            return compare(*parse_prediction(stored), kv_line or "")
        except ValueError:
            return f"KV pool prediction unavailable: {stored}"
    recipe_label = labels.get(f"{LABEL}.recipe")
    if not recipe_label:
        return None
    import json

    from ..plan import status_comparison
    from ..settings import resolve

    try:
        return status_comparison(resolve(overrides=json.loads(recipe_label)), kv_line or "")
    except Exception as exc:  # noqa: BLE001 - a planner problem must not break status
        return f"KV pool prediction unavailable: {exc}"


def _planned_page_cache(labels: dict) -> int | None:
    """Bytes the plan left to the page cache (stored by serve in the kv-plan label), if known."""
    import json

    try:
        gib = json.loads(labels.get(f"{LABEL}.kv-plan") or "{}").get("page_cache_gib")
    except ValueError:
        return None
    return int(float(gib) * 1024**3) if gib is not None else None


def collect(name: str, mem_warn_pct: float = 10.0) -> dict:
    from .. import engine, engine_read

    try:
        container = engine_read.find(name)  # plain Engine API GETs: no docker-py import
    except LookupError:  # TLS or ssh DOCKER_HOST: the SDK knows how
        container = engine.find(engine.connect(), name)
    if container is None:
        return {"name": name, "state": "absent"}
    st = engine.state(container)
    labels = container.labels
    ep = running.endpoint(container)
    out: dict = {
        "name": name, "state": st.status, "exit_code": st.exit_code if st.status != "running" else None,
        "health": st.health, "started_at": st.started_at,
        "profile": labels.get(f"{LABEL}.profile"), "base": labels.get(f"{LABEL}.base"),
        "image": labels.get(f"{LABEL}.image"), "mode": labels.get(f"{LABEL}.mode"),
        "url": f"{ep.url}/v1", "bind": labels.get(f"{LABEL}.bind"),
        "api_key": ep.key, "api_key_mode": labels.get(f"{LABEL}.api-key"),
        "settings_hash": labels.get(f"{LABEL}.settings"),
    }
    out["exposed_without_key"] = out["bind"] not in ("127.0.0.1", "::1") and out["api_key_mode"] != "required"
    logs = engine.tail(container, 3000)
    kv = [ln for ln in logs if KV_LINE.search(ln)]
    out["kv_cache_line"] = kv[-1].strip() if kv else None
    out["kv_cache_plan"] = plan_comparison(labels, out["kv_cache_line"])
    out["patch_lines"] = list(dict.fromkeys(ln.strip() for ln in logs if PATCH_LINE.search(ln)))[-8:]
    from .. import bootlog, mempressure

    verdict = bootlog.verdict_for_labels(labels, logs)
    out["context"] = {"level": verdict[0], "text": verdict[1]} if verdict else None
    mem = mempressure.read()
    out["memory"] = mem.as_dict()
    out["memory_findings"] = [{"level": lv, "text": tx} for lv, tx in mempressure.findings(
        mem, warn_pct=mem_warn_pct, plan_page_cache=_planned_page_cache(labels), running=st.status == "running")]
    out["guard"] = guard_status(container, name)
    out["api"] = "down"
    if st.status == "running":
        health = api.get(f"{ep.url}/health", timeout=2)
        out["api"] = "up" if health.status == 200 else "loading"
        if health.status == 200:
            m = api.get(f"{ep.url}/metrics", timeout=3)
            if m.status == 200:
                text = m.body.decode("utf-8", "replace")
                sums = api.metric_sums(text, METRICS)
                out["requests_running"] = sums.get("vllm:num_requests_running")
                out["requests_waiting"] = sums.get("vllm:num_requests_waiting")
                q = sums.get("vllm:prefix_cache_queries_total")
                out["prefix_cache_hit_rate"] = (sums.get("vllm:prefix_cache_hits_total", 0.0) / q) if q else None
                # since boot (None: no MTP, or nothing drafted yet)
                out["mtp_acceptance_length"] = acceptance_length(sums.get(SPEC_DRAFTS), sums.get(SPEC_ACCEPTED))
                out |= mtp_by_position(text, sums.get(SPEC_DRAFTS))
    else:
        out["last_lines"] = logs[-5:]
    return out


def mtp_by_position(metrics: str, drafts: float | None) -> dict:
    """Each draft position's acceptance since boot (accepted at that position / drafts), and the
    tokens a step would yield at each depth up to the server's: 1 + the rates of the positions it
    keeps. A draft is accepted only after every one before it, so a shallower depth keeps exactly
    the first rates; those figures need no model (what each depth costs a step does:
    benchmarks/recipe48-h200, run8). {} without MTP or before the first draft."""
    per_pos = positions(api.metric_by_label(metrics, SPEC_PER_POS, "position").items())
    if not drafts or not per_pos or sorted(per_pos) != list(range(len(per_pos))):
        return {}
    rates = [per_pos[p] / drafts for p in range(len(per_pos))]
    tokens = [1 + sum(rates[:d]) for d in range(1, len(rates) + 1)]
    return {"mtp_acceptance_per_position": [round(r, 4) for r in rates],
            "mtp_tokens_per_step_by_depth": [round(t, 3) for t in tokens]}


def guard_status(server, name: str) -> dict | None:
    """The memory guard beside the server: its state and its last event (a stop says why)."""
    from .. import engine
    from ..guard import GUARD_LABEL, last_event

    reader = getattr(server, "reader", None)
    try:
        found = reader.containers(f"{GUARD_LABEL}={name}") if reader is not None else \
            server.client.containers.list(all=True, filters={"label": f"{GUARD_LABEL}={name}"})
    except Exception:  # noqa: BLE001 - the guard's state must not break status
        return None
    if not found:
        return None
    g = found[0]
    st = engine.state(g)
    ev = last_event(engine.tail(g, 200))
    return {"name": g.name, "state": st.status, "last_event": ev,
            "stopped_server": ev is not None and ev.get("event") in ("stopping", "stopped"),
            "reason": ev.get("reason") if ev and ev.get("event") in ("stopping", "stopped") else None}


def is_deployment(settings) -> bool:
    """NODES given, or the container NAME on this engine is one box of a multi-node deployment."""
    if settings["NODES"]:
        return True
    from .. import engine, engine_read

    try:
        c = engine_read.find(settings["NAME"])
    except LookupError:
        c = engine.find(engine.connect(), settings["NAME"])
    return c is not None and bool(c.labels.get(f"{LABEL}.nodes"))


def run_deployment(args: argparse.Namespace, settings) -> int:
    from .. import deploy
    from ..errors import ContainerMissing

    try:
        rows = deploy.status(deploy.locate(settings) or [])
    except ContainerMissing:
        rows = []
    if not rows:
        print_json({"name": settings["NAME"], "state": "absent", "nodes": []}) if args.json \
            else print(f"{settings['NAME']}: absent (no box of {settings['NODES']} has it)")
        return 0
    if args.json:
        print_json({"name": settings["NAME"], "nodes": rows})
        return 0
    boxes = [r for r in rows if r["node"] != "router"]
    router = [r for r in rows if r["node"] == "router"]
    print(f"{settings['NAME']}: {rows[0].get('parallel') or '?'} deployment on {len(boxes)} boxes"
          + (f", endpoint {router[0]['url']} (P/D router)" if router and router[0].get("url") else ""))
    rep = Report()
    ids = {r.get("image_id") for r in rows if r.get("image_id")}
    for row in rows:
        where = f"router on {row['box']}" if row["node"] == "router" else f"node {row['node']} ({row.get('role', '?')}) on {row['box']}"
        if row["state"] == "absent":
            rep.fail(f"{where}: no container")
            continue
        text = f"{where}: {row['name']} {row['state']}" + (f", API {row['api']} {row['url']}" if row.get("url") else "")
        (rep.ok if row["state"] == "running" else rep.fail)(text)
        for ln in row.get("last_lines", []):
            print(f"    {ln}")
    if len(ids) > 1:
        rep.warn("the boxes run different images: flash doctor compares them")
    return 0


def run(args: argparse.Namespace) -> int:
    r = recipe.load(args.recipe)
    if is_deployment(r.settings):
        return run_deployment(args, r.settings)
    info = collect(r.settings["NAME"], r.settings["MEM_PRESSURE_WARN"])
    if args.json:
        print_json(info)
        return 0
    print(f"{info['name']}: {info['state']}" + (f"  (profile: {info.get('profile')})" if info.get("profile") else ""))
    if info["state"] == "absent":
        return 0
    rep = Report()
    rep.info(f"image {info['image']} (base {info['base']}, mode {info['mode']}), API {info['url']}")
    if info["state"] == "running":
        (rep.ok if info["api"] == "up" else rep.info)(f"API {info['api']}")
    else:
        rep.fail(f"exit code {info['exit_code']}")
        for ln in info.get("last_lines", []):
            print(f"    {ln}")
    if info["api_key"]:
        rep.info(f"API key: {info['api_key']}")
    if info["exposed_without_key"]:
        rep.warn(f"published on {info['bind']} WITHOUT an API key (API_KEY=off)")
    if info["kv_cache_line"]:
        rep.info(info["kv_cache_line"][-120:])
    if info.get("kv_cache_plan"):
        rep.info(info["kv_cache_plan"])
    if info.get("context"):
        {"ok": rep.ok, "warn": rep.warn, "fail": rep.fail}[info["context"]["level"]](info["context"]["text"])
    for f in info.get("memory_findings") or []:
        getattr(rep, f["level"])(f["text"])
    g = info.get("guard")
    if g is None:
        rep.info("memory guard: none (GUARD=0, or started by an older flash)")
    elif g["stopped_server"]:
        when = g["last_event"].get("at")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if when else "?"
        (rep.fail if info["state"] != "running" else rep.warn)(f"memory guard stopped the server at {stamp}: {g['reason']}")
    else:
        (rep.ok if g["state"] == "running" else rep.warn)(f"memory guard {g['name']} {g['state']}")
    for ln in info["patch_lines"]:
        rep.info(ln[-140:])
    if "requests_running" in info:
        rate = info.get("prefix_cache_hit_rate")
        mtp = info.get("mtp_acceptance_length")
        rep.info(f"requests running {info['requests_running']:.0f}, waiting {info['requests_waiting'] or 0:.0f}, "
                 f"prefix-cache hit rate {'n/a' if rate is None else f'{rate:.1%}'}"
                 + ("" if mtp is None else f", MTP acceptance length {mtp:.2f} since boot"))
        rates = info.get("mtp_acceptance_per_position")
        if rates:
            depths = ", ".join(f"{d} {t:.2f}" for d, t in enumerate(info["mtp_tokens_per_step_by_depth"], 1))
            rep.info(f"MTP acceptance by draft position {' / '.join(f'{r:.2f}' for r in rates)}; "
                     f"tokens a step at depth {depths}")
    return 0
