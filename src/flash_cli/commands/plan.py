"""`flash plan [PROFILE] [K=V…] [--hardware gb10|h200|…] [--config PATH] [--json]`: the memory budget before a boot.

Weights by component (checkpoint headers when the snapshot is on disk), the KV pool as vLLM's
hybrid allocator will lay it out, the tokens the boot log will print, the concurrency at CTX and
what is left to the host and to the page cache for the PLE table. Exit 1 when the recipe cannot
fit (the same findings `flash doctor` prints).
"""

from __future__ import annotations

import argparse

from pathlib import Path

from .. import recipe
from ..errors import UsageError
from ..output import print_json
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help=summary("plan"),
                       description=__doc__.split("\n\n")[0])
    recipe.add_arguments(p)
    # the names live in plan/hardware.py's PRESETS (an unknown one is refused with the list); not
    # imported here: that pulls in the whole planner on every command's start
    p.add_argument("--hardware", metavar="NAME", help="plan for a named hardware preset (gb10, h200, …; an unknown "
                   "name lists them) instead of detecting this machine")
    p.add_argument("--no-snapshot", action="store_true", help="ignore the checkpoint on disk; plan from the geometry")
    p.add_argument("--config", metavar="PATH", help="plan for this checkpoint directory (or its config.json) instead "
                   "of MODEL's snapshot under HF_CACHE, e.g. a tiny test checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import plan as planner
    from ..plan import hardware

    if args.hardware:
        hw, how = hardware.preset(args.hardware), f"preset {args.hardware}"
    else:
        hw, how = hardware.detect()
    r = recipe.load(args.recipe)
    snapshot: Path | bool | None = None if args.no_snapshot else True
    if args.config:
        snapshot = Path(args.config).expanduser()
        if not (snapshot / "config.json" if snapshot.is_dir() else snapshot).is_file():
            raise UsageError(f"--config {args.config}: no config.json there",
                             hint="give a checkpoint directory holding config.json, or the config.json itself")
    result = planner.deployed(r.settings, hw, snapshot=snapshot, hw_how=how)  # 2-4 boxes: each box's needs too
    result["profile"] = r.profile.name
    result.pop("rank", None)  # its numbers are in result["parallel"]["ranks"]
    failed = any(level == "fail" for level, _ in result["findings"])
    if args.json:
        result["findings"] = [{"level": level, "text": text} for level, text in result["findings"]]
        print_json(result)
        return 1 if failed else 0
    print(render(result))
    return 1 if failed else 0


def render(p: dict) -> str:
    b, lay, host = p["budget"], p["kv_layout"], p["host"]
    lo, hi = p["kv_cache_tokens_range"]
    lines = [
        f"plan: profile '{p['profile']}' on {p['hardware']['name']} ({p['hardware']['how']})",
        *(["  one box serving the whole recipe alone, for comparison (the deployment's boxes follow):"]
          if p.get("parallel") else []),
        f"  KV pool        ~{p['kv_cache_tokens']:,} tokens (expected {lo:,}–{hi:,}), {p['kv_cache_gib']} GiB",
        f"  concurrency    {p['max_concurrency']:.2f} requests of CTX={p['max_concurrency_at']:,} "
        f"({p['one_request_at_ctx_gib']} GiB each)",
        f"  per token      {p['kv_bytes_per_token']:,.0f} B of KV (block {lay['block_size']} tokens, "
        f"{lay['bytes_per_block']:,} B per block)",
        f"  budget         GPU_MEM={b['gpu_mem']} → {b['requested_gib']} GiB = weights {b['weights_gib']} + activations "
        f"{b['activations_gib']} + top-k buffers {b['topk_buffers_gib']} + runtime {b['runtime_overhead_gib']} + KV {b['kv_cache_gib']}",
        "  weights        " + ", ".join(f"{k} {v}" for k, v in p["weights"]["gib"].items()),
    ]
    if b.get("outside_budget_gib"):
        head = b["draft_head_outside_gib"]
        lines.append(f"  outside        up to {b['outside_budget_gib']} GiB beyond GPU_MEM: the QSA indexer's logits "
                     f"({b['qsa_logits_outside_gib']} GiB from the first prefill on), which vLLM's profile run never "
                     "allocates"
                     + (f", and patch 10's draft-head copy ({head} GiB), which it books after its peak" if head else ""))
    if p.get("prefix_cache"):
        from ..plan import prefix

        lines.append(prefix.line(p["prefix_cache"]))
    if p.get("long_prefill"):
        from ..plan import prefill

        lines.append(prefill.line(p["long_prefill"]))
    if host.get("page_cache_for_ple_gib") is not None:
        lines.append(f"  host           {host['page_cache_for_ple_gib']} GiB left to the page cache for the "
                     f"{host['ple_table_gib']} GiB PLE table ({host['ple_table_cached_fraction']:.0%} of it)")
    if p.get("parallel"):
        from ..plan import parallel

        lines.append(f"  {p['parallel']['mode']}: each box of the deployment:")
        lines += parallel.render(p["parallel"])
    for level, text in p["findings"]:
        lines.append(f"  [{level}] {text}")
    lines.append("  assumptions:")  # one per line: a joined paragraph of them was unreadable
    lines += [f"    - {a}" for a in p["assumptions"]]
    return "\n".join(lines)
