"""`flash eval [PROFILE] [K=V…] [--url URL] [--tasks a,b] [--label L] [--limit N]`: quality numbers
from lm-evaluation-harness against the server; `flash eval --compare A B` puts two labels side by side."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .. import recipe
from ..errors import ContainerMissing, UsageError
from ..output import say


def register(sub: argparse._SubParsersAction) -> None:
    from ..quality import DEFAULT_LIMIT, DEFAULT_TASKS

    p = sub.add_parser("eval", help="quality numbers with lm-evaluation-harness; --compare A B side by side",
                       description="Run lm-eval's tasks against the server's chat API (the running container NAME, "
                       f"or --url) and write eval-LABEL.json. Default tasks {','.join(DEFAULT_TASKS)} with "
                       f"--limit {DEFAULT_LIMIT} each: minutes on a Spark. The data sets download on first use.")
    recipe.add_arguments(p)
    p.add_argument("--url", help="the server's base URL (default: the running container NAME's)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated lm-eval task names")
    p.add_argument("--label", help="name of this run (default: the profile); the file is eval-LABEL.json")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="documents per task (0: all)")
    p.add_argument("--concurrency", type=int, default=None, help="parallel requests (default: SEQS)")
    p.add_argument("--max-gen-toks", type=int, default=1024, help="answer length cap per request")
    p.add_argument("--include-path", help="a folder of extra lm-eval task YAMLs (your own or offline tasks)")
    p.add_argument("--out", default="eval-results", help="folder for eval-LABEL.json (default ./eval-results)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print two results (labels in --out, or JSON "
                   "paths) side by side; runs nothing")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    p.set_defaults(func=run)


def _load(ref: str, out: Path) -> dict:
    path = Path(ref) if ref.endswith(".json") else out / f"eval-{ref}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--compare {ref}: cannot read {path} ({exc})",
                         hint=f"a label with eval-LABEL.json in {out}, or a path to such a file") from None


def run(args: argparse.Namespace) -> int:
    from .. import quality

    out = Path(args.out)
    if args.compare:
        print(quality.compare(_load(args.compare[0], out), _load(args.compare[1], out)))
        return 0
    r = recipe.load(args.recipe)
    s = r.settings
    label = args.label or r.profile.name
    if not re.fullmatch(r"[\w.-]{1,64}", label):
        raise UsageError(f"--label {label!r} is not valid", hint="letters, digits, '.', '_' and '-', at most 64")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UsageError(f"--tasks {args.tasks!r} names no task", hint="e.g. --tasks gsm8k,ifeval")
    if args.limit < 0:
        raise UsageError(f"--limit {args.limit} is negative", hint="a document count per task, 0 for all")
    headers: dict[str, str] = {}
    if args.url:
        url, model = args.url.rstrip("/").removesuffix("/v1"), s["SERVED_MODEL_NAME"]
        from .. import state

        key = state.read_api_key(s["NAME"])
        if key:
            headers["Authorization"] = f"Bearer {key}"
    else:
        from .. import engine_read, running

        c = engine_read.find(s["NAME"])
        if c is None:
            raise ContainerMissing(f"no flash container named {s['NAME']!r} to evaluate",
                                   hint="start one (flash serve), or give --url")
        ep = running.endpoint(c)
        url, model = ep.url, ep.model or s["SERVED_MODEL_NAME"]
        if ep.key:
            headers["Authorization"] = f"Bearer {ep.key}"
    plan = quality.EvalPlan(label, url, model, tasks, args.limit or None, args.concurrency or s["SEQS"],
                            args.max_gen_toks, args.include_path, headers)
    if args.dry_run:
        print(json.dumps(plan.describe(), indent=2))
        return 0
    say(f"eval '{label}': {', '.join(tasks)} against {url} ({model}), limit {plan.limit or 'all'}, "
        f"{plan.concurrency} concurrent")
    rec = quality.run(plan)
    path = quality.save(rec, out)
    for task, metrics in rec["tasks"].items():
        for metric, cell in metrics.items():
            print(f"{task:24s} {metric:32s} {quality._fmt(cell)}")
    say(f"wrote {path} ({rec['seconds']:.0f} s); compare two labels: flash eval --compare A B")
    return 0
