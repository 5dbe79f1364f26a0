"""The boot log's "GPU KV cache size: N tokens" next to the planner's prediction.

Kept apart from `flash_cli.plan` so `flash status` can print the comparison from the prediction
that `flash serve` stored in a container label, without importing the planner on every call."""

from __future__ import annotations

import json
import re

KV_LINE = re.compile(r"KV cache size:\s*(\d[\d,]*)\s*tokens")


def prediction_label(predicted: int, lo: int, hi: int, hardware: str, page_cache_gib: float | None = None) -> str:
    d = {"tokens": predicted, "lo": lo, "hi": hi, "hardware": hardware}
    if page_cache_gib is not None:
        d["page_cache_gib"] = page_cache_gib
    return json.dumps(d, separators=(",", ":"))


def parse_prediction(label: str) -> tuple[int, int, int]:
    """(predicted, lo, hi) from a label `prediction_label` wrote; ValueError on anything else."""
    try:
        d = json.loads(label)
        predicted, lo, hi = int(d["tokens"]), int(d["lo"]), int(d["hi"])
    except (TypeError, KeyError, ValueError, OverflowError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"not a KV prediction label: {label!r}") from exc
    return predicted, lo, hi


def compare(predicted: int, lo: int, hi: int, kv_log_line: str) -> str:
    m = KV_LINE.search(kv_log_line or "")
    if not m:
        return f"KV pool: predicted {predicted:,} tokens (no 'GPU KV cache size' line in the log yet)"
    measured = int(m.group(1).replace(",", ""))
    if measured == 0:
        return f"KV pool: measured 0 tokens, predicted {predicted:,}"
    err = (predicted - measured) / measured * 100
    inside = "inside" if lo <= measured <= hi else "outside"
    return (f"KV pool: measured {measured:,} tokens, predicted {predicted:,} ({err:+.1f}%; "
            f"{inside} the expected {lo:,}–{hi:,})")
