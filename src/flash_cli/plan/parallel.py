"""`flash plan` for two boxes: what each rank holds and the pool(s) the deployment gets.

dp2 / pd: every box runs a whole replica, so each box's pool is exactly the one-box plan; dp2
serves both pools behind one API (aggregate = 2 pools, each request lives in one of them).
tp2 / pp2: one model over two GPUs, one pool. First-order model, stated as such: weights split
evenly over the two ranks (replicated norms, gates and biases are well under 1% of them);
tp2 splits every KV and state cache by heads and pp2 by layers, so a token costs each rank half
its one-box bytes; activations, top-k buffers and the runtime overhead stay per rank (NCCL's own
buffers come on top, inside the fitted overhead's band). The PLE table is mmapped on each box
from its own page cache, as on one box.
"""

from __future__ import annotations

from typing import Any

GIB = 1024**3


def plan(single: dict[str, Any], mode: str) -> dict[str, Any]:
    b = single["budget"]
    one_tokens, one_kv = single["kv_cache_tokens"], b["kv_cache_gib"]
    if mode in ("dp2", "pd"):
        roles = ["replica 0", "replica 1"] if mode == "dp2" else ["prefill", "decode"]
        per = {"weights_gib": b["weights_gib"], "kv_cache_gib": one_kv, "kv_cache_tokens": one_tokens,
               "max_concurrency": single["max_concurrency"]}
        return {"mode": mode, "ranks": [{"role": r, **per} for r in roles],
                "pools": 2, "aggregate": {"kv_cache_tokens": 2 * one_tokens if mode == "dp2" else one_tokens,
                                          "max_concurrency": round(2 * single["max_concurrency"], 3)
                                          if mode == "dp2" else single["max_concurrency"]},
                "note": ("two independent pools behind the head's API: a request lives in one of them, so the "
                         "longest request is the one-box CTX" if mode == "dp2" else
                         "prefill box's pool holds prompts in flight, decode box's pool the running requests")}
    weights = b["weights_gib"] / 2
    kv_rank = b["requested_gib"] - (weights + b["activations_gib"] + b["topk_buffers_gib"] + b["runtime_overhead_gib"]) \
        if not b["kv_cache_mem_set"] else one_kv
    # each token costs a rank half its one-box bytes: the pool holds what 2 × kv_rank would on one box
    per_byte = one_tokens / one_kv if one_kv > 0 else 0.0
    tokens = int(2 * kv_rank * per_byte) if kv_rank > 0 else 0
    conc = single["max_concurrency"] * (2 * kv_rank / one_kv) if one_kv > 0 and kv_rank > 0 else 0.0
    rank = {"weights_gib": round(weights, 3), "kv_cache_gib": round(kv_rank, 3)}
    return {"mode": mode, "ranks": [{"role": "head", **rank}, {"role": "worker", **rank}], "pools": 1,
            "aggregate": {"kv_cache_tokens": tokens, "max_concurrency": round(conc, 3)},
            "note": f"one pool split over both ranks ({'heads' if mode == 'tp2' else 'layers'}); "
                    f"~{tokens / one_tokens if one_tokens else 0:.2f}× the one-box pool (first-order: weights and KV "
                    "split evenly, per-rank activations and overhead as on one box)"}


def render(p: dict[str, Any]) -> list[str]:
    lines = [f"  {p['mode']:<14} " + "; ".join(f"{r['role']}: weights {r['weights_gib']} GiB, KV {r['kv_cache_gib']} GiB"
                                          for r in p["ranks"])]
    agg = p["aggregate"]
    lines.append(f"  {'deployment':<14} {p['pools']} pool(s), ~{agg['kv_cache_tokens']:,} tokens, "
                 f"{agg['max_concurrency']:.2f} requests of CTX ({p['note']})")
    return lines
