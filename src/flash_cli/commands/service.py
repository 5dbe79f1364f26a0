"""`flash service install|status|uninstall [PROFILE] [K=V…] [--user]`: the recipe as a systemd
unit (service.py builds it); `flash service run` is the unit's main process."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import recipe, service, state
from ..errors import ContainerDied, FlashError, UsageError
from ..output import say
from . import summary

FLASH = str(service.REPO / "flash")
CLEAN_EXIT = (0, 143)  # a stopped server: exited by itself on SIGTERM, or with its default disposition


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("service", help=summary("service"),
                       description="A systemd unit (system, or --user) that starts the recipe at boot, drains "
                       "running requests on stop (DRAIN_TIMEOUT) and restarts a failed server with backoff.")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb, text in (("install", "write the unit, enable and start it"),
                       ("status", "the unit's state, its failure count and the container"),
                       ("uninstall", "stop (draining), disable and remove the unit; the container is kept"),
                       ("run", "the unit's main process: start the container, follow it (not for hand use)")):
        v = verbs.add_parser(verb, help=text)
        recipe.add_arguments(v)
        if verb != "run":
            v.add_argument("--user", action="store_true", help="a user unit (~/.config/systemd/user) instead "
                           "of a system one (/etc/systemd/system, needs root)")
            v.add_argument("--dry-run", action="store_true", help="print the unit and the systemctl steps; change nothing")
        if verb == "install":
            v.add_argument("--no-start", action="store_true", help="enable for the next boot, do not start now")
        v.set_defaults(func=globals()[f"cmd_{verb}"])


def _scope(args) -> str:
    return "user" if args.user else "system"


def _systemctl(cmds: list[list[str]]) -> None:
    if not shutil.which("systemctl"):
        raise UsageError("systemctl not found: this host does not run systemd",
                         hint="flash service needs systemd; run flash serve directly instead")
    for cmd in cmds:
        say(f"  $ {' '.join(cmd)}")
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise FlashError(f"{' '.join(cmd)} failed (exit {res.returncode}): {(res.stderr or res.stdout).strip()[:300]}",
                             hint="journalctl -xe; for a user unit: is a user manager running (loginctl enable-linger)?")


def cmd_install(args: argparse.Namespace) -> int:
    from .. import preflight
    from .serve import PLACEHOLDER, plan as serve_plan

    r = recipe.load(args.recipe)
    for p in preflight.recipe(serve_plan(r, PLACEHOLDER)):  # a recipe that cannot boot must not become a boot loop
        p.raise_()
    plan = service.plan_install(list(args.recipe), r.settings, scope=_scope(args), env=dict(os.environ), flash=FLASH,
                                uid=os.getuid(), user=getpass.getuser(), start=not args.no_start)
    if args.dry_run:
        print(f"# {plan.path}")
        print(plan.text, end="")
        for cmd in plan.commands:
            print(f"# then: {' '.join(cmd)}")
        for n in plan.notes:
            say(f"  · {n}")
        return 0
    try:
        plan.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = plan.path.with_name(f".{plan.path.name}.tmp{os.getpid()}")
        tmp.write_text(plan.text)
        os.replace(tmp, plan.path)
    except PermissionError:
        raise UsageError(f"cannot write {plan.path}: a system unit needs root",
                         hint="sudo ./flash service install …, or --user for a user unit") from None
    say(f"  · wrote {plan.path}")
    _systemctl(plan.commands)
    for n in plan.notes:
        say(f"  · {n}")
    print(f"{plan.unit} installed ({plan.scope}); flash service status{' --user' if args.user else ''} shows it")
    return 0


def cmd_uninstall(args: argparse.Namespace) -> int:
    r = recipe.load(args.recipe)
    plan = service.plan_uninstall(r.settings["NAME"], scope=_scope(args), env=dict(os.environ))
    if args.dry_run:
        for cmd in plan.commands[:1]:
            print(f"would run: {' '.join(cmd)}")
        print(f"would remove {plan.path}; then: {' '.join(plan.commands[1])}")
        return 0
    if not plan.path.exists():
        raise UsageError(f"no unit {plan.path}", hint=f"installed as the other scope? try {'without' if args.user else 'with'} --user")
    _systemctl(plan.commands[:1])
    plan.path.unlink()
    _systemctl(plan.commands[1:])
    print(f"{plan.unit} removed; the container {r.settings['NAME']} is kept (flash rm removes it)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    r = recipe.load(args.recipe)
    name = r.settings["NAME"]
    plan = service.plan_uninstall(name, scope=_scope(args), env=dict(os.environ))
    print(f"{plan.unit} ({plan.scope}): {'installed at ' + str(plan.path) if plan.path.exists() else 'not installed'}")
    if shutil.which("systemctl") and not args.dry_run:
        ctl = ["systemctl"] + (["--user"] if args.user else [])
        for what in ("is-enabled", "is-active"):
            res = subprocess.run(ctl + [what, plan.unit], capture_output=True, text=True)
            print(f"  {what}: {(res.stdout or res.stderr).strip() or res.returncode}")
    rec = read_failures(name)
    if rec["failures"]:
        print(f"  failed runs in a row: {rec['failures']} (next start waits {service.backoff_delay(rec['failures'])} s)")
    from .status import collect

    try:
        info = collect(name)
    except FlashError as exc:  # the unit's state is still worth showing without Docker
        print(f"  container {name}: unknown ({exc})")
        return 0
    print(f"  container {name}: {info['state']}" + (f", API {info.get('api')}" if info["state"] == "running" else ""))
    return 0


# --- the unit's main process --------------------------------------------------------------------
def failures_path(name: str) -> Path:
    return state.state_dir() / f"service-{name}.json"


def read_failures(name: str) -> dict:
    try:
        return {"failures": 0, **json.loads(failures_path(name).read_text())}
    except (OSError, ValueError):
        return {"failures": 0}


def write_failures(name: str, n: int) -> None:
    path = failures_path(name)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"failures": n, "at": time.time()}))
    os.replace(tmp, path)


def serve_args(words: list[str]) -> argparse.Namespace:
    """`flash serve WORDS` as serve's own parser reads them (its defaults included), from the
    sibling module: the unit runs the same serve a user would type."""
    from . import serve

    parser = argparse.ArgumentParser(prog="flash")
    serve.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *words])


class _Stopping(Exception):
    pass


def cmd_run(args: argparse.Namespace) -> int:
    """Start the recipe (Docker's restart policy off: systemd restarts) and follow the container."""
    from .. import api, engine, running

    r = recipe.load(args.recipe)
    name = r.settings["NAME"]
    failures = read_failures(name)["failures"]
    delay = service.backoff_delay(failures)

    def on_term(signum, frame):  # systemd stops us after ExecStop (flash stop) has drained
        raise _Stopping()

    signal.signal(signal.SIGTERM, on_term)
    try:
        if delay:
            say(f"service: {failures} failed run(s) in a row; waiting {delay} s before starting (backoff)")
            time.sleep(delay)
        words = serve_args([*args.recipe, "RESTART=no"])
        words.func(words)
        client = engine.connect()
        container = engine.require(client, name)
        ep = running.endpoint(container)
        healthy = False
        while True:
            st = engine.state(container)
            if st.status not in ("running", "created", "restarting"):
                break
            if not healthy and api.get(f"{ep.url}/health", timeout=3).status == 200:
                healthy = True
                write_failures(name, 0)
                say(f"service: {name} is up ({ep.url})")
            time.sleep(service.FOLLOW_INTERVAL_S)
    except _Stopping:
        say("service: stopping")
        return 0
    except FlashError:
        write_failures(name, failures + 1)
        raise
    if st.exit_code in CLEAN_EXIT:
        say(f"service: {name} exited cleanly (code {st.exit_code}: flash stop); done")
        return 0
    write_failures(name, 1 if healthy else failures + 1)
    lines = engine.tail(container, 20)
    print("\n".join(lines), file=sys.stderr)
    raise ContainerDied(f"{name} exited with code {st.exit_code}" + (", OOM-killed" if st.oom_killed else ""),
                        hint="systemd restarts it with backoff; flash logs for the whole log")

