"""`flash setup [PROFILE] [K=V…] [--dry-run]`: image → weights → hybrid → graft, each skipped when done.

Plan first: every step decides whether it is done and what it would run, then the plan is
printed (--dry-run stops there) and executed in order; a failing step stops the rest.
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass
from typing import Callable

from flash_common import releases

from .. import recipe
from ..errors import FlashError, NotAvailable
from ..output import say
from ..profiles import REPO
from ..spec import default_image
from . import summary

# Each checkpoint step exposes is_done(settings) and run_step(settings, dry_run): the download
# module, and the variant steps of `flash prepare` (commands/prepare.py STEPS, which print).
CHECKPOINT_STEPS = {
    "weights": "flash_cli.checkpoint.download",
    "hybrid": "flash_cli.commands.prepare:hybrid",
    "graft": "flash_cli.commands.prepare:graft",
}


@dataclass
class Step:
    name: str
    done: bool
    what: str
    run: Callable[[], None]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("setup", help=summary("setup"))
    recipe.add_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    p.set_defaults(func=run)


def dockerfile_for(base: str) -> str:
    return str(releases.cap(base, "dockerfile"))


def build_args(s) -> dict[str, str]:
    args = {"SELFCHECK": "1" if s["SELFCHECK"] else "0", "FLASH_VLLM_BASE": s["BASE"]}
    if s["BASE_IMAGE"]:
        args["BASE_IMAGE"] = s["BASE_IMAGE"]
    else:  # one Dockerfile serves several releases: FROM the catalogued image where its default differs
        image = releases.get(s["BASE"]).image
        if image != dockerfile_base(dockerfile_for(s["BASE"])):
            args["BASE_IMAGE"] = image
    return args


def dockerfile_base(dockerfile: str) -> str:
    """The Dockerfile's default `ARG BASE_IMAGE=…` (what a build without the arg is FROM)."""
    for line in (REPO / dockerfile).read_text().splitlines():
        if line.startswith("ARG BASE_IMAGE="):
            return line.split("=", 1)[1].strip()
    return "?"


def record_build(client, image: str, base_image: str, labels: dict) -> dict:
    """Remember which base digest an image was built from (state dir images.json)."""
    import datetime

    from .. import state

    digest = None
    try:
        digests = client.images.get(base_image).attrs.get("RepoDigests") or []
        digest = digests[0].split("@", 1)[1] if digests else client.images.get(base_image).id
    except Exception:  # noqa: BLE001 - a missing record must not fail a good build
        pass
    path = state.state_dir() / "images.json"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[image] = {"base_image": base_image, "base_digest": digest, "patchset": labels.get("org.flash.patchset"),
                   "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return data[image]


def image_step(r: recipe.Recipe) -> Step:
    from .. import engine, preflight

    s = r.settings
    image = s["IMAGE"] or default_image(s["BASE"])
    dockerfile = dockerfile_for(s["BASE"])
    args = build_args(s)
    what = f"docker build -f {dockerfile} -t {image} " + " ".join(f"--build-arg {k}={v}" for k, v in args.items()) + f" {REPO}"
    try:
        client = engine.connect()
        done = not preflight.image(s, image, engine.image_labels(client, image))
    except FlashError as exc:
        client, done, what = None, False, f"{what}  (Docker: {exc})"

    def build() -> None:
        c = client or engine.connect()
        if not (REPO / dockerfile).is_file():
            raise NotAvailable(f"{REPO / dockerfile} is missing", hint="the checkout is incomplete: git status")
        log = []
        for chunk in c.api.build(path=str(REPO), dockerfile=dockerfile, tag=image, buildargs=args,
                                 rm=True, forcerm=True, decode=True):
            if "stream" in chunk:
                text = chunk["stream"].rstrip()
                if text:
                    log.append(text)
                    say(f"    {text[:150]}")
            if "error" in chunk:
                raise FlashError(f"docker build of {dockerfile} failed: {chunk['error'].strip()[:300]}",
                                 hint="the last build lines are above")
        labels = engine.image_labels(c, image) or {}
        record = record_build(c, image, args.get("BASE_IMAGE") or dockerfile_base(dockerfile), labels)
        say(f"  ✔ built {image} (base {labels.get('org.flash.base', '?')}, patch set {labels.get('org.flash.patchset', '?')}, "
            f"from {record['base_image']}@{record['base_digest'] or 'unknown digest'})")

    return Step("image", done, what, build)


def checkpoint_step(name: str, r: recipe.Recipe) -> Step:
    try:
        module, _, step = CHECKPOINT_STEPS[name].partition(":")
        mod = importlib.import_module(module)
        if step:
            mod = mod.STEPS[step]
        is_done, run_step = mod.is_done, mod.run_step
    except (ImportError, AttributeError):
        def unavailable() -> None:
            raise NotAvailable(f"the {name} step is not available yet in this checkout")

        return Step(name, False, f"{name}: not available yet", unavailable)
    done = bool(is_done(r.settings))
    return Step(name, done, f"flash {'download' if name == 'weights' else 'prepare ' + name}",
                lambda: run_step(r.settings, dry_run=False))


def plan(r: recipe.Recipe) -> list[Step]:
    steps = [image_step(r), checkpoint_step("weights", r)]
    mode = r.settings["MODE"]
    if mode in ("hybrid", "hybrid-mtp"):
        steps.append(checkpoint_step("hybrid", r))
    if mode == "hybrid-mtp":
        steps.append(checkpoint_step("graft", r))
    return steps


def run(args: argparse.Namespace) -> int:
    r = recipe.load(args.recipe)
    s = r.settings
    steps = plan(r)
    print(f"setup: profile '{r.profile.name}' (image {s['IMAGE'] or default_image(s['BASE'])} from "
          f"{dockerfile_for(s['BASE'])}, mode {s['MODE']}). Every step is skipped when already done.")
    for i, step in enumerate(steps, 1):
        print(f"  {i}/{len(steps)} {step.name:<8} {'done, skipped' if step.done else step.what}")
    if args.dry_run:
        return 0
    for i, step in enumerate(steps, 1):
        if step.done:
            continue
        say(f"\n>> {i}/{len(steps)} {step.name}")
        step.run()
    print(f"ready. next: flash serve {r.profile.name}, then flash wait, then flash test")
    return 0


__all__ = ["register", "run", "plan"]
