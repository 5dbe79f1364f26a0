"""How a long prompt is cut while other requests run: LONG_PREFILL against the KV block.

vLLM's scheduler gives a prompt longer than `--long-prefill-token-threshold` at most that many
tokens a step while other requests are running (0.31+ lift the cap when the prompt is alone in the
batch; 0.29/0.30 apply it always). With prefix caching on, this hybrid model's Mamba groups run in
"align" mode, where a chunk that does not end the prompt must end on a block boundary: a threshold
below the block gives pieces of the threshold until the block's rest, one above it is cut back to
whole blocks. So only a threshold that divides the block (or a multiple of it) keeps every piece at
the threshold. docs/PREFIX-CACHE.md, "A long prefill beside a decoding stream";
tests/vllm/release/check_prefill_beside.py checks these pieces against each release's scheduler.
"""

from __future__ import annotations

# the most prompt tokens a step should carry beside a decoding stream (shared's value before the
# block was taken into account; issue #9's field recipes use 1,024)
PIECE_CAP = 1024


def pieces(threshold: int, block: int, aligned: bool) -> list[int]:
    """The chunks one block's worth of a long prompt goes in beside other requests (a threshold
    at or above the block: the one chunk a step takes, in whole blocks)."""
    if not aligned:
        return [threshold]
    if threshold >= block:
        return [threshold // block * block]
    return [threshold] * (block // threshold) + ([block % threshold] if block % threshold else [])


def divisor_at_most(block: int, cap: int = PIECE_CAP) -> int:
    """The largest divisor of `block` not above `cap`: the threshold that cuts the block evenly."""
    return max(d for d in range(1, min(block, cap) + 1) if block % d == 0)


def plan(s, block: int) -> dict | None:
    """The `long_prefill` section of `flash plan` (None with LONG_PREFILL=0, vLLM's default: a
    long prompt takes the whole BATCHED_TOKENS step beside a stream)."""
    n = s["LONG_PREFILL"]
    if not n:
        return None
    aligned = bool(s["PREFIX_CACHE"])
    per = pieces(n, block, aligned)
    even = divisor_at_most(block)
    return {
        "threshold_tokens": n,
        "block_tokens": block,
        "aligned": aligned,
        "pieces_per_block": per,
        "largest_piece_tokens": max(per),
        "even": len(set(per)) == 1,
        "even_threshold_tokens": even,
    }


def line(p: dict) -> str:
    """One line for `flash plan`'s text output."""
    per = p["pieces_per_block"]
    shown = ", ".join(f"{x:,}" for x in per)
    how = (f"a long prompt beside other requests goes in pieces of {shown} tokens"
           + (f" per {p['block_tokens']:,}-token block" if p["aligned"] and len(per) > 1 else ""))
    return f"  long prefill   LONG_PREFILL={p['threshold_tokens']:,}: {how} (docs/PREFIX-CACHE.md)"


def finding(p: dict) -> tuple[str, str] | None:
    """A warning when the threshold does not cut the block evenly (its largest piece, which sets
    the other streams' worst gaps, is larger than an even cut's); a note when one above the block
    is cut back to whole blocks."""
    per, n, block, even = p["pieces_per_block"], p["threshold_tokens"], p["block_tokens"], p["even_threshold_tokens"]
    if p["aligned"] and n > block and n % block:
        return ("info", f"LONG_PREFILL={n:,} is cut back to whole {block:,}-token blocks with prefix caching on: "
                        f"pieces of {per[0]:,}")
    if p["even"]:
        return None
    return ("warn", f"LONG_PREFILL={n:,} does not divide the {block:,}-token KV block: with prefix caching on a long "
                    f"prompt beside other requests goes in pieces of {', '.join(f'{x:,}' for x in per)}; "
                    f"LONG_PREFILL={even:,} cuts the block evenly ({block // even} pieces of {even:,})")
