"""`flash probe LABEL` (the fixed greedy prompt set → JSON) and `flash probe --diff A B`."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import recipe
from ..errors import CheckFailed, UsageError
from ..gates import target
from ..output import print_json, say
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help=summary("probe"),
                       description="Run the fixed greedy prompt set (temperature 0, first-token logprobs) and save it "
                       "under a label; `flash probe --diff A B` exits 1 at the first byte that differs.")
    p.add_argument("label", nargs="?", help="name for this run (e.g. hybrid, hybrid-mtp)")
    recipe.add_arguments(p)
    target.add_arguments(p)
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two probes (labels or .json paths)")
    p.add_argument("--out", type=Path, help="write here instead of <state>/probes/LABEL.json")
    p.add_argument("--max-tokens", type=int, default=400, help="tokens per prompt (default 400)")
    p.add_argument("--logprob-tol", type=float, default=1e-4, help="--diff: allowed first-token logprob difference (default 1e-4)")
    p.add_argument("--json", action="store_true", help="print the probe (or the diff verdict) as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..gates import probe

    if args.diff:
        a, b = (probe.load(probe.locate(x)) for x in args.diff)
        same, lines = probe.diff(a, b, args.logprob_tol)
        if args.json:
            print_json({"identical": same, "a": args.diff[0], "b": args.diff[1], "lines": lines})
        else:
            print(f"probe diff {a['label']} ({a.get('model')}, {a.get('created')}) vs {b['label']} ({b.get('model')}, {b.get('created')})")
            for line in lines:
                print("  " + line)
            print("IDENTICAL" if same else "DIFFERENT")
        if not same:
            raise CheckFailed("the probes differ", hint=None)
        return 0
    if not args.label:
        raise UsageError("give a label (flash probe LABEL) or --diff A B")
    if not probe.LABEL_RE.fullmatch(args.label):
        raise UsageError(f"bad probe label {args.label!r}", hint="letters, digits, . _ - (up to 64)")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens {args.max_tokens} must be at least 1")
    r = recipe.load(args.recipe)
    tgt = target.resolve(args, r)
    client = target.client(tgt, r)
    model = tgt.model
    if not model:
        reply = client.get("/v1/models", timeout=30)
        if not reply.ok or not reply.body.get("data"):
            raise CheckFailed(f"cannot read the model id from {tgt.url}/v1/models: {reply.why()}")
        model = reply.body["data"][0]["id"]

    def show(i: int, item: dict) -> None:
        say(f"  [{i + 1}] {item['tokens']} tok in {item['seconds']:.1f} s ({item['tok_s'] or 0:.1f} tok/s)")

    doc = probe.run(client, model, args.label, args.max_tokens, on_item=show)
    path = probe.write(doc, args.out or probe.probe_dir() / f"{args.label}.json")
    if args.json:
        print_json(doc)
    else:
        print(f"wrote {path}")
        say(f"compare with another run: flash probe --diff {args.label} OTHER")
    return 0
