"""`flash bench`: decode at concurrency levels, prefill sizes, TTFT cold and on a prefix hit;
medians and spread; two servers alternate ABBA; raw JSONL + summary + PNG plots."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from .. import recipe
from ..errors import CheckFailed, UsageError
from ..output import print_json, say
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help=summary("bench"),
                       description="Measure the server (default: the running container) or compare two (--url A "
                       "--url B, alternated ABBA). Levels and repeats are the BENCH_* settings. Results: "
                       "raw.jsonl, summary.json, meta.json and PNGs in --out (default <state>/bench/<time>).")
    recipe.add_arguments(p)
    p.add_argument("--url", action="append", default=[], help="server URL; give twice to compare two servers")
    p.add_argument("--label", action="append", default=[], help="name per --url (default A, B)")
    p.add_argument("--api-key-file", type=Path, help="API key file (default: $VLLM_API_KEY)")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="decode prompts, one per line (UTF-8; blank lines and lines starting with # skipped), "
                        "instead of the built-in English ones: measure on your own traffic's language and "
                        "kind, e.g. MTP acceptance with DRAFT_VOCAB=0 vs 1")
    p.add_argument("--out", type=Path, help="results folder (created; must be empty if it exists)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--dry-run", action="store_true", help="print the measurement plan, send nothing")
    p.add_argument("--json", action="store_true", help="print summary.json on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..gates import bench, target
    from ..state import state_dir

    r = recipe.load(args.recipe)
    s = r.settings
    conc = bench.parse_levels(s["BENCH_CONCURRENCY"], "BENCH_CONCURRENCY")
    sizes = bench.parse_levels(s["BENCH_PREFILL"], "BENCH_PREFILL")
    if len(args.url) > 2:
        raise UsageError("flash bench compares at most two servers (--url A --url B)")
    if args.label and len(args.label) != max(1, len(args.url)):
        raise UsageError(f"{len(args.label)} --label for {max(1, len(args.url))} server(s): give one per --url")
    targets: list[bench.Target] = []
    if args.url:
        for i, url in enumerate(args.url):
            ns = argparse.Namespace(url=url, model=None, api_key_file=args.api_key_file)
            t = target.resolve(ns, r)
            targets.append(bench.Target(args.label[i] if args.label else "AB"[i], t.url, t.key, t.model))
    else:
        t = target.resolve(argparse.Namespace(url=None, model=None, api_key_file=args.api_key_file), r)
        targets.append(bench.Target(args.label[0] if args.label else s["NAME"], t.url, t.key, t.model))
    if len({t.label for t in targets}) != len(targets):
        raise UsageError("the two --label values must differ")
    prompts = bench.read_prompts(args.prompts) if args.prompts else bench.DECODE_PROMPTS
    points = bench.plan([t.label for t in targets], conc, sizes, s["BENCH_REPEATS"])
    if args.dry_run:
        doc = {"targets": [{"label": t.label, "url": t.url} for t in targets], "points": len(points),
               "order": [f"{p.target}:{p.kind}:{p.param}#{p.repeat}" for p in points],
               "decode_max_tokens": s["BENCH_DECODE_TOKENS"], "decode_prompts": len(prompts)}
        if args.json:
            print_json(doc)
        else:
            print(f"{len(points)} measurements: decode c={conc}, prefill {sizes} tokens, x{s['BENCH_REPEATS']} "
                  f"on {', '.join(t.label + '=' + t.url for t in targets)}")
            print("order: " + " ".join(doc["order"]))
        return 0
    out = args.out or state_dir() / "bench" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty", hint="give a new folder")
    # model ids up front: a wrong URL fails here, not after half a benchmark
    from ..gates.client import Client

    for t in targets:
        reply = Client(t.url, t.key, 30).get("/v1/models")
        if not reply.ok or not reply.body.get("data"):
            raise CheckFailed(f"{t.label} ({t.url}): /v1/models {reply.why()}", hint="is it up? flash test --url ...")
        t.model = t.model or reply.body["data"][0]["id"]
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": shlex.join(["flash", *sys.argv[1:]]) if sys.argv[0].endswith(("flash", "__main__.py")) else None,
            "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": bench.machine(),
            "targets": [{"label": t.label, "url": t.url, "model": t.model} for t in targets],
            "settings": {k: s.as_env()[k] for k in ("BENCH_CONCURRENCY", "BENCH_PREFILL", "BENCH_REPEATS", "BENCH_DECODE_TOKENS")},
            "decode_prompts": bench.prompts_source(args.prompts, prompts)}
    bench.write_json(out / "meta.json", meta)
    raw = (out / "raw.jsonl").open("a", encoding="utf-8")

    def sink(rec: dict) -> None:  # one line per measurement, flushed: an interrupted run keeps its data
        raw.write(json.dumps(rec) + "\n")
        raw.flush()

    say(f"flash bench: {len(points)} measurements -> {out}")
    try:
        records = bench.run(targets, points, s["BENCH_DECODE_TOKENS"], s["TEST_TIMEOUT"], sink,
                            progress=sys.stderr.isatty(), prompts=prompts)
    finally:
        raw.close()
    summary = bench.summarize(records)
    bench.write_json(out / "summary.json", summary)
    plots = [] if args.no_plots else bench.plot(records, out)
    if args.json:
        print_json({**summary, "out": str(out), "plots": [p.name for p in plots]})
    else:
        for line in bench.table(summary):
            print(line)
        print(f"results: {out} (raw.jsonl, summary.json, meta.json" + (", " + ", ".join(p.name for p in plots) if plots else "") + ")")
    if summary["errors"]:
        raise CheckFailed(f"{summary['errors']} measurement(s) failed; see raw.jsonl")
    return 0
