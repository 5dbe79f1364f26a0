"""`flash test`: the gate. Checks with stable names; exit 1 when a required check fails."""

from __future__ import annotations

import argparse
import sys

from .. import recipe
from ..errors import CheckFailed
from ..output import _paint, print_json
from ..gates import target


def register(sub: argparse._SubParsersAction) -> None:
    from ..gates.checks import CHECK_NAMES

    p = sub.add_parser("test", help="gate a running server: health, model, context, coherence, effort, tool_call, "
                       "prefill, prefix_cache, determinism, decode, metrics",
                       description="Run the checks against the server (default: the running flash container, "
                       "found by label). Exit 0 only when every required check passes. Thresholds are the "
                       "TEST_* settings (KEY=VALUE arguments override them). The context check compares the "
                       "served max_model_len with the recipe: the container's labels, or with --url the "
                       "PROFILE/K=V words given (none: N/A).")
    recipe.add_arguments(p)
    target.add_arguments(p)
    p.add_argument("--only", action="append", default=[], metavar="CHECK", choices=CHECK_NAMES,
                   help="run only these checks (repeatable; health and model always run)")
    p.add_argument("--skip", action="append", default=[], metavar="CHECK", choices=CHECK_NAMES,
                   help="skip these checks (repeatable)")
    p.add_argument("--expect-ple", choices=("auto", "yes", "no"), default="auto",
                   help="PLE counters in /metrics: yes = required, no = must be absent, auto = all 8 or none")
    p.add_argument("--json", action="store_true", help="print {\"checks\": [...], ...} on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..gates import checks

    # A URL needs no profile: without recipe words, `--url` runs on the table's defaults (the
    # TEST_* thresholds) and the context check says N/A instead of guessing a recipe.
    r = recipe.load(args.recipe, use_profile=not (args.url and not target.recipe_given(args)))
    tgt = target.resolve(args, r)
    # the container says whether the PLE mmap patch runs with its counters on: then they must show
    expect_ple = "yes" if args.expect_ple == "auto" and tgt.ple else args.expect_ple
    from ..bootlog import expected_context

    ctx = checks.Context(target.client(tgt, r), checks.Thresholds.from_settings(r.settings),
                         expect_model=tgt.model or None, expect_ple=expect_ple,
                         expect_ctx=expected_context(tgt.recipe) if tgt.recipe is not None else None,
                         ctx_source=tgt.recipe_source)
    if not args.json:
        print(f"flash test  {tgt.url}" + (f"  ({tgt.source})" if tgt.source else ""))
    width = max(len(n) for n in checks.CHECK_NAMES) + 2

    def show(res: checks.Result) -> None:
        if args.json:
            return
        mark = {"pass": _paint("32", "✔", sys.stdout), "fail": _paint("31", "✘", sys.stdout),
                "skip": _paint("2", "-", sys.stdout)}[res.status]
        print(f"  {mark} {res.name:<{width}}{res.detail}", flush=True)
        if res.status == "fail" and res.data.get("hint"):
            print(f"    {'':<{width}}{_paint('2', 'hint: ' + res.data['hint'], sys.stdout)}", flush=True)

    results = checks.run(ctx, set(args.only) or None, set(args.skip) or None, on_result=show)
    summ = checks.summary(results)
    if args.json:
        print_json({"url": tgt.url, "model": ctx.model, "ok": summ["ok"],
                    "checks": [res.as_dict() for res in results], "summary": summ})
    else:
        print(f"{summ['passed']} passed, {summ['failed']} failed, {summ['skipped']} skipped")
    if not summ["ok"]:
        raise CheckFailed(f"required check(s) failed: {', '.join(summ['failed_required'])}",
                          hint=None if args.json else "details above; thresholds are TEST_* settings")
    return 0
