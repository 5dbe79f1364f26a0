"""`flash monitor up|down|status`: Prometheus + Grafana + node-exporter next to the server."""

from __future__ import annotations

import argparse
import shlex

from .. import recipe
from ..errors import ImageMissing
from ..output import print_json, say
from ..render import to_docker_run, to_kwargs
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("monitor", help=summary("monitor"),
                       description="Start (up), remove (down) or list (status) the monitoring containers of the "
                       "recipe's server. Ports: MONITOR_PROM_PORT, MONITOR_NODE_PORT (always 127.0.0.1: no "
                       "authentication) and MONITOR_GRAFANA_PORT (on MONITOR_BIND; beyond loopback it requires a "
                       "login). Images are pinned by tag and digest.")
    p.add_argument("action", choices=("up", "down", "status"))
    recipe.add_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan (docker run lines, files), change nothing")
    p.add_argument("--volumes", action="store_true", help="down: also remove the Prometheus/Grafana data volumes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import monitor, state

    r = recipe.load(args.recipe)
    plan = monitor.plan(r.settings, state.state_dir())
    if args.action == "up" and args.dry_run:
        if args.json:
            print_json(plan.as_dict())
        else:
            print(f"# config rendered into {plan.config_dir}: {', '.join(sorted(plan.files))}")
            for c in plan.containers.values():
                print(shlex.join(to_docker_run(c)))
            for k, v in plan.urls.items():
                print(f"# {k}: {v}")
        return 0
    from .. import engine

    client = engine.connect()
    found = client.containers.list(all=True, filters={"label": f"{monitor.LABEL}.monitor={plan.name}"})
    if args.action == "status":
        rows = [{"name": c.name, "role": c.labels.get(f"{monitor.LABEL}.role"), "status": c.status,
                 "image": (c.image.tags or [c.image.id])[0]} for c in found]
        if args.json:
            print_json({"containers": rows, "urls": plan.urls})
        else:
            for row in rows:
                print(f"{row['role']:<14}{row['status']:<10}{row['name']}")
            if not rows:
                print("no monitoring containers (flash monitor up)")
        return 0
    if args.action == "down":
        if args.dry_run:
            for c in found:
                print(f"docker rm -f {c.name}")
            return 0
        for c in found:
            say(f"  removing {c.name}")
            c.remove(force=True)
        if args.volumes:
            for vol in (f"{plan.name}-prometheus-data", f"{plan.name}-grafana-data"):
                try:
                    client.volumes.get(vol).remove()
                except Exception:  # absent is fine: down is idempotent
                    pass
        print(f"monitoring for {plan.name}: removed {len(found)} container(s)")
        return 0
    # up
    monitor.write_files(plan)
    by_name = {c.name: c for c in found}
    for c in plan.containers.values():
        _ensure_image(client, c.image)
        old = by_name.get(c.name)
        if old is not None:
            if old.status == "running" and old.attrs.get("Config", {}).get("Image") == c.image:
                say(f"  {c.name}: running")
                continue
            old.remove(force=True)
        say(f"  starting {c.name} ({c.image.split('@')[0]})")
        client.containers.run(**to_kwargs(c))
    for k, v in plan.urls.items():
        print(f"{k}: {v}")
    say(f"Grafana admin password: {plan.config_dir / 'grafana-admin'} "
        + ("(login required: Grafana listens beyond loopback)" if plan.exposed else "(anonymous users can view)"))
    return 0


def _ensure_image(client, ref: str) -> None:
    from docker.errors import DockerException, ImageNotFound

    try:
        client.images.get(ref)
        return
    except ImageNotFound:
        pass
    repo, _, digest = ref.partition("@")
    say(f"  pulling {ref}")
    try:
        client.images.pull(repo.rsplit(":", 1)[0], tag=digest)  # by digest: what was pinned, nothing else
    except DockerException as exc:
        raise ImageMissing(f"cannot pull {ref}: {str(exc).splitlines()[0][:160]}",
                           hint="this host needs registry access once (or docker load the image)") from None
