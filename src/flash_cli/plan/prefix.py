"""Where prefix-cache hits land on this hybrid model, from the KV block and the prefill chunk.

docs/PREFIX-CACHE.md explains it; the vllm tier (tests/vllm/release/check_prefix_hits.py) asserts
these numbers against each release's own scheduler. In brief: hits come in whole blocks; a Mamba
state exists only where a prefill chunk ended (chunks are cut back to blocks); vLLM's default
retention keeps a prompt's last block boundary and the junctions it saw, so the second of two
prompts that share a prefix and then go on by more than a block misses and the third hits, and
PREFIX_RETAIN=dense keeps every chunk end too.
"""

from __future__ import annotations

from flash_common import releases


def plan(s, block: int) -> dict | None:
    """The `prefix_cache` section of `flash plan` (None with PREFIX_CACHE=0)."""
    if not s["PREFIX_CACHE"]:
        return None
    guarded = bool(s["MTP"]) and s["MTP_BLOCK_DROP"]  # vLLM guards the drafter's last matched block
    lookahead = guarded and releases.has(s["BASE"], "mtp_hash_lookahead")
    drops = guarded and not lookahead
    # the shortest shared prefix that hits: two blocks where the drafter drops the last matched one;
    # a block and the token after it where the hash lookahead proves that token instead (0.33); a
    # block with MTP off or MTP_BLOCK_DROP=0
    first = 2 * block if drops else block + (1 if lookahead else 0)
    chunk_end = s["BATCHED_TOKENS"] // block * block
    return {
        "block_tokens": block,
        "first_hit_tokens": first,
        "drafter_drops_block": drops,
        "chunk_end_tokens": chunk_end,
        "retain": s["PREFIX_RETAIN"],
        # dense: the second of two prompts with long tails of their own hits the first chunk end
        # once the shared prefix reaches this far past it
        "dense_second_hit_from_tokens": chunk_end + first - block,
    }


def line(p: dict) -> str:
    """One line for `flash plan`'s text output."""
    first = f"from a shared prefix of {p['first_hit_tokens']:,} tokens on"
    if p["drafter_drops_block"]:
        first += " (the MTP drafter drops the last matched block on this base: MTP_BLOCK_DROP=0 keeps it)"
    dense = (f"{p['chunk_end_tokens']:,} of them once the shared prefix reaches "
             f"{p['dense_second_hit_from_tokens']:,} tokens")
    second = ("a prompt that shares a prefix with one earlier prompt and then goes on by more than a block gets "
              + (dense + " (PREFIX_RETAIN=dense)" if p["retain"] == "dense"
                 else f"nothing, the next such prompt hits (PREFIX_RETAIN=dense: {dense})"))
    return (f"  prefix cache   hits in {p['block_tokens']:,}-token blocks, {first}; {second} "
            "(docs/PREFIX-CACHE.md)")
