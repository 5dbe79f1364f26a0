"""`flash plan` for 2 to 4 boxes: what each box holds and needs, and the pool(s) the deployment gets.

dpN / pd layouts: every box runs a whole replica, so each box's plan is exactly the one-box plan;
dpN serves N pools behind one API (a request lives in one of them), pdN has one prefill pool and
N-1 decode pools. tpN / ppN / tp2pp2: one model over the boxes, one pool; each box's plan is the
planner run for ONE rank (`plan.build(..., split=(tp, pp))`): its share of the weights (first
order: split evenly), its own KV layout (tp splits the QSA and GDN heads, but the 2 QSA KV heads
only down to one per rank: at tp4 they are replicated, so a token costs each rank half its
one-box QSA bytes, not a quarter; pp splits the layers), per-rank activations, top-k buffers and
runtime overhead as on one box, and the page cache left on that box for its own mmap of the PLE
table (patch 1 maps it on every box). NCCL's buffers come on top, inside the overhead's band.
"""

from __future__ import annotations

from typing import Any

GIB = 1024**3


def _box(role: str, index: int, p: dict[str, Any]) -> dict[str, Any]:
    host = p.get("host", {})
    return {"box": index, "role": role, "weights_gib": p["budget"]["weights_gib"],
            "kv_cache_gib": p["budget"]["kv_cache_gib"], "kv_cache_tokens": p["kv_cache_tokens"],
            "kv_bytes_per_token": p["kv_bytes_per_token"], "vllm_claim_gib": p["budget"]["requested_gib"],
            "page_cache_for_ple_gib": host.get("page_cache_for_ple_gib"),
            "ple_table_cached_fraction": host.get("ple_table_cached_fraction"),
            "max_concurrency": p["max_concurrency"], "fits": p["fits"]}


def plan(single: dict[str, Any], lay, rank: dict[str, Any] | None = None) -> dict[str, Any]:
    """`single`: the one-box plan; `lay`: the Layout (or its PARALLEL name); `rank`: the plan of one
    rank (tp/pp layouts; required there)."""
    if isinstance(lay, str):
        from .. import layout

        lay = layout.parse(lay)
    n = lay.boxes
    roles = lay.roles()
    if not lay.rendezvous:  # dp, pd: every box a whole server, its pool the one-box plan
        boxes = [_box(f"replica {i}" if lay.kind == "dp" else r, i, single) for i, r in enumerate(roles)]
        decode_pools = n if lay.kind == "dp" else n - 1
        return {"mode": lay.name, "boxes": n, "ranks": boxes, "pools": n,
                "aggregate": {"kv_cache_tokens": decode_pools * single["kv_cache_tokens"],
                              "max_concurrency": round(decode_pools * single["max_concurrency"], 3)},
                "kv_share_per_token": 1.0,
                "note": (f"{n} independent pools behind the head's API: a request lives in one of them, so the "
                         "longest request is the one-box CTX" if lay.kind == "dp" else
                         f"the prefill box's pool holds prompts in flight, the {n - 1} decode box"
                         f"{'es' if n > 2 else ''}' pool{'s' if n > 2 else ''} the running requests (the aggregate)")}
    if rank is None:
        raise ValueError(f"PARALLEL={lay.name}: the per-rank plan is needed (plan.build(..., split=(tp, pp)))")
    boxes = [_box(r, i, rank) for i, r in enumerate(roles)]
    share = rank["kv_bytes_per_token"] / single["kv_bytes_per_token"] if single["kv_bytes_per_token"] else 0.0
    tokens = rank["kv_cache_tokens"]
    what = {"tp": f"heads over {lay.tp} ranks", "pp": f"layers over {lay.pp} stages",
            "tppp": f"heads over {lay.tp} ranks and layers over {lay.pp} stages"}[lay.kind]
    note = (f"one pool split over the {n} ranks ({what}); each token costs a rank {share:.2f} of its one-box KV bytes"
            + (f" (the QSA KV heads are replicated above their count, so not 1/{lay.tp})" if lay.tp > 2 else "")
            + (f"; ~{tokens / single['kv_cache_tokens']:.2f}× the one-box pool" if single["kv_cache_tokens"] > 0
               else "; one box alone would have no KV pool at these settings")
            + " (first-order: weights split evenly, per-rank activations and overhead as on one box)")
    if lay.ep:
        note += "; expert parallel: each box holds its share of the 512 experts whole instead of a slice of each"
    return {"mode": lay.name, "boxes": n, "ranks": boxes, "pools": 1,
            "aggregate": {"kv_cache_tokens": tokens, "max_concurrency": rank["max_concurrency"]},
            "kv_share_per_token": round(share, 3), "note": note}


def render(p: dict[str, Any]) -> list[str]:
    lines = []
    for r in p["ranks"]:
        cache = "" if r["page_cache_for_ple_gib"] is None else (
            f", page cache {r['page_cache_for_ple_gib']} GiB ({r['ple_table_cached_fraction']:.0%} of the PLE table)")
        lines.append(f"  box {r['box']:<10} {r['role']}: vLLM claims {r['vllm_claim_gib']} GiB = weights "
                     f"{r['weights_gib']} GiB + KV {r['kv_cache_gib']} GiB + the rest{cache}")
    agg = p["aggregate"]
    lines.append(f"  {p['mode'] + ' (' + str(p['boxes']) + ' boxes)':<14} {p['pools']} pool(s), "
                 f"~{agg['kv_cache_tokens']:,} tokens, {agg['max_concurrency']:.2f} requests of CTX ({p['note']})")
    return lines
