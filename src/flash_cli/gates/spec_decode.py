"""vLLM's speculative-decoding counters (V1 engine, with MTP) and what they say: the acceptance
length, the tokens a sequence gains per verification step (the verified token plus the accepted
drafts). Read by `flash bench` (per measurement, from counter deltas) and `flash status` (since
boot). Light at import: `flash status` imports it on its start path."""

from __future__ import annotations

import time

from .client import Client

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # labelled `position`


def positions(pairs) -> dict[int, float]:
    """{draft position: accepted} from (position label, value) pairs: ASCII digit labels only
    ("²".isdigit() holds and int() refuses it), "01" and "1" one position, their values summed."""
    out: dict[int, float] = {}
    for pos, value in pairs:
        if pos is not None and pos.isascii() and pos.isdigit():
            out[int(pos)] = out.get(int(pos), 0.0) + (value or 0.0)
    return out


def acceptance_length(drafts: float | None, accepted: float | None) -> float | None:
    """1 + accepted / drafts; None without drafts (MTP off, or nothing drafted yet)."""
    return 1 + (accepted or 0.0) / drafts if drafts else None


def spec_counters(client: Client) -> dict | None:
    """The spec-decode counters now: {drafts, accepted, per_pos: {position: accepted}}; None when
    the server has none (MTP off) or /metrics does not answer (the point is measured without)."""
    from .metrics import MetricsError, parse

    reply = client.get("/metrics", timeout=10)
    if reply.status != 200 or not reply.text:
        return None
    try:
        snap = parse(reply.text)
    except MetricsError:
        return None
    drafts, accepted = snap.total(SPEC_DRAFTS), snap.total(SPEC_ACCEPTED)
    if drafts is None or accepted is None:
        return None
    labels = {lb.get("position") for lb in snap.labels_of(SPEC_PER_POS)} - {None}
    per_pos = positions((pos, snap.total(SPEC_PER_POS, position=pos)) for pos in labels)
    return {"drafts": drafts, "accepted": accepted, "per_pos": per_pos}


def settled_spec_counters(client: Client, before: dict, settle_s: float = 0.25, limit_s: float = 3.0) -> dict | None:
    """The counters once they stop moving: a server may record a step's counts just after the
    stream that step ended has been answered."""
    deadline = time.monotonic() + limit_s
    last = spec_counters(client)
    while last is not None and time.monotonic() < deadline:
        time.sleep(settle_s)
        now = spec_counters(client)
        if now == last and now["drafts"] > before["drafts"]:
            break
        last = now
    return last


def acceptance(before: dict | None, after: dict | None) -> dict:
    """Acceptance length and per-position rates over one point's drafts ({} without MTP)."""
    if before is None or after is None:
        return {}
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return {}
    accepted = after["accepted"] - before["accepted"]
    per_pos = [(after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0)) / drafts
               for p in sorted(after["per_pos"])]
    return {"mtp_drafts": drafts, "mtp_accepted": accepted, "mtp_acceptance_length": acceptance_length(drafts, accepted),
            **({"mtp_acceptance_per_position": per_pos} if per_pos else {})}
