"""`flash test`: the gate. Checks with stable names; exit 1 when a required check fails."""

from __future__ import annotations

import argparse
import sys

from .. import recipe
from ..errors import CheckFailed, UsageError
from ..output import _paint, print_json
from ..gates import target
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    from ..gates.checks import CHECK_NAMES

    p = sub.add_parser("test", help=summary("test"),
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
    p.add_argument("--untrained", action="store_true",
                   help="the server runs a random-weight test checkpoint: the checks that need a trained model ("
                   + ", ".join(checks_needing_training()) + ") are reported n/a, not run")
    p.add_argument("--na", action="append", default=[], metavar="CHECK[=REASON]",
                   help="declare a check not applicable (repeatable): reported as 'n/a: REASON', never silently; "
                   "health and model always apply")
    p.add_argument("--expect-ple", choices=("auto", "yes", "no"), default="auto",
                   help="PLE counters in /metrics: yes = required, no = must be absent, auto = all 8 or none")
    p.add_argument("--json", action="store_true", help="print {\"checks\": [...], ...} on stdout")
    p.set_defaults(func=run)


def checks_needing_training() -> list[str]:
    from ..gates.checks import NEEDS_TRAINED

    return list(NEEDS_TRAINED)


def not_applicable(args: argparse.Namespace) -> dict[str, str]:
    """{check: reason} from --untrained and --na CHECK[=REASON]; a bad name is a UsageError."""
    from ..gates.checks import CHECK_NAMES, NEEDS_TRAINED

    out: dict[str, str] = {}
    if getattr(args, "untrained", False):
        out.update({name: f"untrained checkpoint (--untrained): {why}" for name, why in NEEDS_TRAINED.items()})
    for item in getattr(args, "na", None) or []:
        name, _, reason = item.partition("=")
        name = name.strip()
        if name not in CHECK_NAMES or name in ("health", "model"):
            allowed = [n for n in CHECK_NAMES if n not in ("health", "model")]
            raise UsageError(f"--na {item!r}: {name!r} is not a check that can be declared n/a",
                             hint=f"--na accepts: {', '.join(allowed)} (as CHECK or CHECK=REASON)")
        out[name] = reason.strip() or "declared not applicable (--na)"
    return out


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
                         expect_model=tgt.model or None, expect_ple=expect_ple, not_applicable=not_applicable(args),
                         expect_ctx=expected_context(tgt.recipe) if tgt.recipe is not None else None,
                         ctx_source=tgt.recipe_source)
    if not args.json:
        print(f"flash test  {tgt.url}" + (f"  ({tgt.source})" if tgt.source else ""))
    width = max(len(n) for n in checks.CHECK_NAMES) + 2

    def show(res: checks.Result) -> None:
        if args.json:
            return
        mark = {"pass": _paint("32", "✔", sys.stdout), "fail": _paint("31", "✘", sys.stdout),
                "skip": _paint("2", "-", sys.stdout), "n/a": _paint("33", "○", sys.stdout)}[res.status]
        print(f"  {mark} {res.name:<{width}}{res.detail}", flush=True)
        if res.status == "fail" and res.data.get("hint"):
            print(f"    {'':<{width}}{_paint('2', 'hint: ' + res.data['hint'], sys.stdout)}", flush=True)

    results = checks.run(ctx, set(args.only) or None, set(args.skip) or None, on_result=show)
    summ = checks.summary(results)
    if args.json:
        print_json({"url": tgt.url, "model": ctx.model, "ok": summ["ok"],
                    "checks": [res.as_dict() for res in results], "summary": summ})
    else:
        na = summ["not_applicable"]
        print(f"{summ['passed']} passed, {summ['failed']} failed, {summ['skipped']} skipped"
              + (f", {len(na)} n/a ({', '.join(na)})" if na else ""))
    if not summ["ok"]:
        raise CheckFailed(f"required check(s) failed: {', '.join(summ['failed_required'])}",
                          hint=None if args.json else "details above; thresholds are TEST_* settings")
    return 0
