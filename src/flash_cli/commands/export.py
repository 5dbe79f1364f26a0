"""`flash export compose|sparkrun [PROFILE] [K=V…] [-o FILE]`: the recipe as one file that runs
without this repository (export.py builds it from the same RunSpec `flash serve` runs)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import recipe, state
from ..errors import UsageError
from ..output import say

PLACEHOLDER = "<SNAPSHOT>"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="the recipe as one docker-compose.yml or a sparkrun recipe (compose|sparkrun)",
                       description="Write the recipe `flash serve` would run as a file that needs no clone of "
                       "this repository: a docker-compose.yml (with the memory guard beside the server) or a "
                       "sparkrun recipe.")
    verbs = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    for fmt, text in (("compose", "one docker-compose.yml: image, mounts, env, key as a secret file, healthcheck"),
                      ("sparkrun", "a sparkrun recipe (YAML) of the same run spec")):
        v = verbs.add_parser(fmt, help=text)
        recipe.add_arguments(v)
        v.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
        v.set_defaults(func=run)


def _spec(r: recipe.Recipe):
    from ..spec import build

    s = r.settings
    if s["PARALLEL"] != "none":
        raise UsageError(f"PARALLEL={s['PARALLEL']}: export writes one-box recipes only",
                         hint="export each box with PARALLEL=none, or serve the deployment with flash serve")
    snap = r.snapshot()
    if snap is None:
        say(f"  ! {s['MODEL']} is not in {r.hf_cache}: the model path holds {PLACEHOLDER}; download it first "
            "(flash download) or replace it by hand")
    return build(s, profile=r.profile.name, snapshot=snap.name if snap else PLACEHOLDER,
                 hf_cache=str(r.hf_cache), state_dir=str(state.state_dir()))


def run(args: argparse.Namespace) -> int:
    from .. import export

    r = recipe.load(args.recipe)
    spec = _spec(r)
    for w in spec.warnings:
        say(f"  ! {w}")
    if args.format == "compose":
        doc = export.compose(spec, r.settings, str(r.hf_cache), guard=r.settings["GUARD"])
        text = export.compose_text(doc, export.header_lines(spec, r.profile.name, r.settings))
    else:
        from .. import sparkrun

        text = sparkrun.recipe_text(spec, r.settings, r.profile)
    if args.output:
        path = Path(args.output)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        say(f"wrote {path}")
    else:
        sys.stdout.write(text)
    return 0
