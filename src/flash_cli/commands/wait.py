"""`flash wait`: poll until the API answers; a dead container fails at once with its logs."""

from __future__ import annotations

import argparse
import re
import sys
import time

from .. import api, bootlog, engine, recipe, running
from ..errors import ContainerDied, ContextMismatch, NotReady
from ..output import say
from . import summary

PROGRESS = re.compile(r"Loading safetensors|Loading weights took|Model loading took|torch.compile took|"
                      r"Capturing CUDA|KV cache size|prewarm|PLE mmap|startup")
KV_LINE = re.compile(r"GPU KV cache size|Maximum concurrency")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wait", help=summary("wait"),
                       description="Poll until /health answers; a dead container fails at once. A boot silent "
                       "for BOOT_STALL s in a known phase is named with its remedy; a served context other "
                       "than the recipe's fails with exit 11 (docs/FIELD.md).")
    recipe.add_arguments(p)
    p.add_argument("--timeout", type=float, default=None, help="seconds (default: the TIMEOUT setting, 1800)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls (default 2)")
    p.set_defaults(func=run)


def died(container, st: engine.State) -> ContainerDied:
    lines = engine.tail(container, 20)
    print("\n".join(lines), file=sys.stderr)
    oom = ", OOM-killed" if st.oom_killed else ""
    return ContainerDied(f"{container.name} is {st.status} (exit code {st.exit_code}{oom}); last log lines above",
                         hint="flash logs for more; fix and flash serve again")


def run(args: argparse.Namespace) -> int:
    r = recipe.load(args.recipe)
    timeout = args.timeout if args.timeout is not None else r.settings["TIMEOUT"]
    from .. import deploy

    boxes = deploy.locate(r.settings)
    if boxes is not None:  # a multi-node deployment: every box is watched, a dead rank fails at once
        return deploy.wait(boxes, timeout, args.interval)
    client = engine.connect()
    container = engine.require(client, r.settings["NAME"])
    ep = running.endpoint(container)
    start = time.monotonic()
    tty = sys.stderr.isatty()
    last = ""
    watch = bootlog.BootWatch(r.settings["BOOT_STALL"])
    while True:
        st = engine.state(container)  # the container first: a dead one never becomes healthy
        if st.status not in ("running", "created", "restarting"):
            raise died(container, st)
        if st.status == "running" and api.get(f"{ep.url}/health", timeout=3).status == 200:
            break
        now = time.monotonic()
        elapsed = now - start
        tail = engine.tail(container, 40)
        if elapsed > timeout:
            stall = watch.current(now)
            raise NotReady(f"{container.name} is still not up after {elapsed:.0f} s"
                           + (f"; {stall.message()}" if stall else ""),
                           hint=f"remedy for '{stall.phase.name}': {stall.phase.remedy}" if stall else "check: flash logs")
        stall = watch.feed(tail, now)
        if stall:
            if tty:
                sys.stderr.write("\n")
            say(f"  stalled? {stall.message()}\n  remedy for '{stall.phase.name}': {stall.phase.remedy}\n"
                f"  (BOOT_STALL={r.settings['BOOT_STALL']} s; still waiting until TIMEOUT={timeout:.0f} s)")
        hits = [ln for ln in tail if PROGRESS.search(ln)]
        if hits and hits[-1] != last:
            last = hits[-1]
            if not tty:
                say(f"  {elapsed:5.0f}s {last[:110]}")
        if tty:
            sys.stderr.write(f"\r  {elapsed:5.0f}s {last[:90]:<90}")
            sys.stderr.flush()
        time.sleep(args.interval)
    if tty:
        sys.stderr.write("\n")
    elapsed = time.monotonic() - start
    print(f"ready after {elapsed:.0f} s.")
    boot = engine.tail(container, 2000)
    kv = [ln for ln in boot if KV_LINE.search(ln)]
    for ln in kv[-2:]:
        print(f"  {ln.strip()[:160]}")
    verdict = bootlog.verdict_for_labels(container.labels, boot)
    if verdict:
        print(f"  {verdict[1]}")
    model = ep.model
    reply = api.get(f"{ep.url}/v1/models", ep.key)
    if reply.status == 200:
        model = ",".join(m.get("id", "?") for m in reply.json().get("data", [])) or model
    print(f"API: {ep.url}/v1 (model '{model}')" + ("  [API key: flash status shows it]" if ep.key else ""))
    if verdict and verdict[0] == "fail":
        raise ContextMismatch(verdict[1].removeprefix("context: "),
                              hint="flash test's context check fails the same way; flash logs | grep 'Using max model len'")
    say("try: flash test")
    return 0

