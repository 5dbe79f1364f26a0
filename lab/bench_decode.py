#!/usr/bin/env python3
"""Decode tok/s at the real model's shape (issue 12): stock vs PIECEWISE + eager PLE gather vs
FULL + hoisted PLE gather, at concurrency 1/4/8 with MTP=2, on vLLM with `--load-format dummy`.

Run from the repository root as `python3 -m lab.bench_decode COMMAND` (benchmarks/decode-h200/README.md
has the exact sequence for the H200). The work lives in lab/decode/, one module a job; this is the CLI.

Commands:

  prepare DIR [--quant nvfp4|fp8] [--ple-rows full|N]
      DIR/model: the real config.json (every text_config field of the published checkpoint spelled
      out, none left to transformers' defaults), the quantization config, small
      tokenizer/processor files; DIR/ple: a PLE table written by flash's writer (real row width
      160 fp8 bytes, 16 heads, 128 shards; full = 320,001,536 rows = 47.68 GiB, or N rows with
      `ngram_vocab_size_base` lowered to match so every hashed id is in range, said in meta.json).
      --quant nvfp4: the nvidia checkpoint's MIXED_PRECISION config (NVFP4 experts). --quant fp8:
      the same with the routed experts as FP8_PB_WO (block 128, the MTP experts' own format), for a
      GPU whose vLLM cannot run NVFP4 MoE (Hopper); ~113 GiB of experts, fits 139 GiB.
  plan DIR [--port P]       the three server configurations (env + argv), as JSON
  serve-run DIR CONFIG --out FILE.jsonl [--levels 1,4,8] [--tokens 256] [--repeats 3]
      start `vllm serve` for CONFIG (stock | eager | hoisted), wait for /health, measure, stop it;
      one JSON line per measurement appended to FILE (raw; nothing averaged away).
  run URL --label L --out FILE.jsonl   measure a server someone else started
  plot FILE.jsonl... --out PNG          medians per config and concurrency, ratios vs stock, and
                                       the paired ratios pooled with a 95% interval (`paired`)
  greedy URL --out FILE.json / greedy-diff A.json B.json
      exactness: fixed token-id prompts (EOS inside, a long one for chunked prefill, a repeat and a
      shared prefix for prefix-cache hits), greedy token ids; the diff exits 1 at the first change

Each request: a distinct random token-id prompt (64 ids, no shared prefix), `max_tokens` tokens with
`ignore_eos` (random weights would stop at random lengths), greedy, streamed. Aggregate tok/s = all
completion tokens / (last end - first send); per-stream tok/s = (tokens - 1) / (end - first chunk).
MTP acceptance comes from the server's spec-decode counters around each measurement. With random
weights the draft rarely agrees, so the acceptance length is ~1: the step shapes (3 tokens per
request per step) match serving with MTP=2, the tokens per step do not.
"""

from __future__ import annotations

import argparse
import sys

from lab.decode import client, greedy, model, plot, schedule, servers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir")
    p.add_argument("--quant", choices=("nvfp4", "fp8"), default="nvfp4")
    p.add_argument("--ple-rows", default="full", help="'full' (320,001,536 rows, 47.68 GiB) or a row count")
    p.add_argument("--layers", type=int, default=model.LAYERS, help="decoder layers: a multiple of 4 up to 48 (the real 48)")
    p.set_defaults(func=model.prepare, configs_only=False)  # bench_recipe's prepare --configs-only; here always the table
    p = sub.add_parser("configs", help="print the servers `matrix --configs` accepts (gpu_session checks against it)")
    p.set_defaults(func=lambda args: print(",".join(servers.ALL_CONFIGS)) or 0)
    p = sub.add_parser("plan")
    p.add_argument("dir")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=servers.plan_cmd)
    for name in ("serve-run", "run"):
        p = sub.add_parser(name)
        if name == "serve-run":
            p.add_argument("dir")
            p.add_argument("config", choices=servers.ALL_CONFIGS)
            p.add_argument("--port", type=int, default=8000)
            p.add_argument("--boot-timeout", type=float, default=1200)
            p.add_argument("--log")
            p.set_defaults(func=schedule.serve_run)
        else:
            p.add_argument("url")
            p.add_argument("--label", required=True)
            p.set_defaults(func=schedule.run_cmd)
        p.add_argument("--out", required=True, help="JSONL file, appended")
        p.add_argument("--levels", default="1,4,8")
        p.add_argument("--tokens", type=int, default=256)
        p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("matrix", help="boot the configs side by side, measure them in turn (rotated), stop")
    p.add_argument("dir")
    p.add_argument("--configs", default=",".join(servers.CONFIGS))
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", required=True, help="JSONL file, appended")
    p.add_argument("--logs", help="server logs go here (default: beside --out)")
    p.add_argument("--levels", default="1,4,8")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--boot-timeout", type=float, default=600)
    p.add_argument("--warmup-tokens", type=int, default=64, help="an untimed round per config and level first (0: none)")
    p.add_argument("--ple-settle", type=float, default=client.PLE_SETTLE_S,
                   help="s to wait after each eager/hoisted round before reading its PLE counters (0: read at once)")
    p.add_argument("--deadline", type=float, default=3600, help="s from start: stop measuring (rows so far are kept)")
    p.set_defaults(func=schedule.matrix)
    p = sub.add_parser("greedy", help="fixed token-id prompts, greedy, token ids to a JSON file")
    p.add_argument("url")
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--eos", type=int, default=248044, help="the config's eos_token_id (PLE context resets there)")
    p.add_argument("--vocab", type=int, default=248320)
    p.set_defaults(func=greedy.greedy_cmd)
    p = sub.add_parser("greedy-diff", help="exit 1 at the first token that differs")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(func=greedy.greedy_diff)
    p = sub.add_parser("plot")
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--json", help="also write the summary, ratios and extrapolation here")
    p.add_argument("--bandwidth-gbs", type=float, help="the H200's measured copy bandwidth (GB10 estimate)")
    p.set_defaults(func=plot.plot_cmd)
    args = ap.parse_args(argv)
    if getattr(args, "ple_settle", 0) < 0:
        raise SystemExit(f"--ple-settle {args.ple_settle}: give 0 (read at once) or seconds such as {client.PLE_SETTLE_S}")
    if getattr(args, "warmup_tokens", 0) < 0:
        raise SystemExit(f"--warmup-tokens {args.warmup_tokens}: give 0 (no warm-up) or a token count such as 64")
    if getattr(args, "ple_rows", "full") != "full" and not str(args.ple_rows).isdigit():
        raise SystemExit(f"--ple-rows {args.ple_rows!r}: give 'full' or a row count such as 32000000")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
