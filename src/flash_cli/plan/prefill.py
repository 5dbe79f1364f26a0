"""How a long prompt is cut while other requests run: LONG_PREFILL against the KV block.

vLLM's scheduler gives a prompt longer than `--long-prefill-token-threshold` at most that many
tokens a step while other requests are running (0.31+ lift the cap when the prompt is alone in the
batch; 0.29/0.30 apply it always). With prefix caching on, this hybrid model's Mamba groups run in
"align" mode, where a chunk that does not end the prompt must end on a block boundary: a threshold
below the block gives pieces of the threshold until the block's rest, one above it is cut back to
whole blocks. So only a threshold that divides the block (or a multiple of it) keeps every piece at
the threshold. docs/PREFIX-CACHE.md, "A long prefill beside a decoding stream";
tests/vllm/release/check_prefill_beside.py checks these pieces against each release's scheduler.

A step that carries a piece beside the decoding streams runs inside a CUDA graph only when its
tokens fit vLLM's largest capture size (what the compilation config vLLM's parser ends up with sets:
GRAPH_TOKENS, COMPILE_FLAGS, a `-cc` in EXTRA; else vLLM's own 2 x SEQS x (1 + MTP), at most 512);
outside one it took ~2.3x as long at 32 layers on an H100 (benchmarks/latency48-h100 run2).
check_prefill_beside.py also holds `capture_max` to each release's `_set_cudagraph_sizes`.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..compile_config import CC_FLAGS, compilation_config, cudagraph_mode
from ..spec import compilation_args

# the most prompt tokens a step should carry beside a decoding stream (shared's value before the
# block was taken into account; issue #9's field recipes use 1,024)
PIECE_CAP = 1024
# vLLM's default capture ceiling off data-center Blackwell (the GB10 and Hopper included)
DEFAULT_GRAPH_CAP = 512


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


def grid_max(cap: int) -> int:
    """The largest size on vLLM's capture grid not above `cap`: 1, 2, 4, then multiples of 8 below
    256, then multiples of 16."""
    if cap >= 256:
        return 256 + (cap - 256) // 16 * 16
    if cap >= 8:
        return cap // 8 * 8
    return max(n for n in (1, 2, 4) if n <= cap)


def grid_up(tokens: int) -> int:
    """The smallest size on vLLM's capture grid that holds `tokens`: a GRAPH_TOKENS that covers them."""
    step = 16 if tokens > 256 else 8
    return max(8, -(-tokens // step) * step)


def capture_max(s, extra_words: list[str] = ()) -> int | None:
    """The largest step, in tokens, vLLM captures CUDA graphs for under these settings (its
    `_set_cudagraph_sizes`, 0.29-0.33), read from the compilation config vLLM's parser ends up with
    (flash's own or COMPILE_FLAGS, then EXTRA's `-cc` words: `compile_config.compilation_config`). None
    where no graph is captured (`--enforce-eager`, `cudagraph_mode` NONE) or the flags do not parse
    (doctor's graph-regime check names those). Sequence parallelism's trimming (tensor parallel with
    `enable_sp`) is not modelled."""
    try:
        argv = compilation_args(s)
    except (ConfigError, ValueError):  # GRAPH_TOKENS beside COMPILE_FLAGS
        return None
    return argv_capture_max(argv + list(extra_words), s["SEQS"], s["MTP"], s["BATCHED_TOKENS"])


def argv_capture_max(argv: list[str], seqs: int, mtp: int, batched: int) -> int | None:
    """capture_max read from a vLLM argv's own flags (a rendered one, or a benchmark row's, which
    outlives the profile that made it), with the sequences, draft tokens and step it runs with."""
    if "--enforce-eager" in argv:
        return None
    try:
        cc = compilation_config(argv)
    except (ConfigError, ValueError):  # a config that is not JSON
        return None
    if cudagraph_mode(argv, cc) == "NONE":
        return None
    sizes = cc.get("cudagraph_capture_sizes")
    if isinstance(sizes, list) and sizes:  # an explicit list: vLLM keeps the sizes up to the step
        kept = [int(n) for n in sizes if str(n).strip().isdigit() and 0 < int(n) <= batched]
        return max(kept) if kept else None
    size = cc.get("max_cudagraph_capture_size")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return batched if batched <= size else grid_max(size)
    return vllm_capture(seqs, mtp, batched)


def vllm_capture(seqs: int, mtp: int, batched: int) -> int:
    """vLLM's own largest capture size (no max_cudagraph_capture_size given). The uniform decode
    sizes vLLM adds (requests x (1 + MTP), at most SEQS requests) never pass the grid's top: the cap
    is BATCHED_TOKENS (captured itself), 512 (on the grid) or 2 x SEQS x (1 + MTP), twice the widest."""
    cap = min(seqs * (1 + mtp) * 2, DEFAULT_GRAPH_CAP, batched)
    return batched if batched == cap else grid_max(cap)


def plan(s, block: int, extra_words: list[str] = ()) -> dict | None:
    """The `long_prefill` section of `flash plan` (None with LONG_PREFILL=0, vLLM's default: a
    long prompt takes the whole BATCHED_TOKENS step beside a stream). `extra_words`: EXTRA, split."""
    n = s["LONG_PREFILL"]
    if not n:
        return None
    aligned = bool(s["PREFIX_CACHE"])
    per = pieces(n, block, aligned)
    even = divisor_at_most(block)
    graphs = capture_max(s, extra_words)
    # the worst step while a long prompt runs beside others: its largest piece plus one decode step
    # (1 + MTP tokens) for every seat, as the profiles count it (shared: 800 + 8 x 3 = 824)
    step = min(max(per), s["BATCHED_TOKENS"]) + s["SEQS"] * (1 + s["MTP"])
    return {
        "threshold_tokens": n,
        "block_tokens": block,
        "aligned": aligned,
        "pieces_per_block": per,
        "largest_piece_tokens": max(per),
        "even": len(set(per)) == 1,
        "even_threshold_tokens": even,
        "step_beside_tokens": step,
        "graph_tokens": graphs,
        "graph_source": graph_source(s, extra_words),
        "in_graphs": None if graphs is None else step <= graphs,
    }


def graph_source(s, extra_words: list[str] = ()) -> str:
    """Who set the capture size: "flags" (COMPILE_FLAGS, or a compilation config in EXTRA, which
    vLLM applies after flash's own), "GRAPH_TOKENS", or "vllm" (its own default)."""
    cc_words = any(w.split("=", 1)[0].split(".", 1)[0] in CC_FLAGS for w in extra_words)
    return "flags" if s["COMPILE_FLAGS"] or cc_words else ("GRAPH_TOKENS" if s["GRAPH_TOKENS"] else "vllm")



def line(p: dict) -> str:
    """One line for `flash plan`'s text output."""
    per = p["pieces_per_block"]
    shown = ", ".join(f"{x:,}" for x in per)
    how = (f"a long prompt beside other requests goes in pieces of {shown} tokens"
           + (f" per {p['block_tokens']:,}-token block" if p["aligned"] and len(per) > 1 else ""))
    graphs = p.get("graph_tokens")
    where = ("" if graphs is None else
             f"; a step beside every stream is {p['step_beside_tokens']:,} tokens, "
             + (f"inside CUDA graphs (captured to {graphs:,})" if p["in_graphs"] else
                f"outside CUDA graphs (captured to {graphs:,})"))
    return f"  long prefill   LONG_PREFILL={p['threshold_tokens']:,}: {how}{where} (docs/PREFIX-CACHE.md)"


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


def graph_finding(p: dict, s) -> tuple[str, str] | None:
    """A warning when a step that carries a piece beside every stream is larger than the largest
    CUDA graph: those steps, all of a long prompt's beside other requests, run outside graphs."""
    if p["in_graphs"] is not False:
        return None
    step, graphs, cover = p["step_beside_tokens"], p["graph_tokens"], grid_up(p["step_beside_tokens"])
    source = p["graph_source"]
    whose = {"flags": "the compilation config of COMPILE_FLAGS / EXTRA",
             "GRAPH_TOKENS": f"GRAPH_TOKENS={s['GRAPH_TOKENS']:,}"}.get(
                 source, f"vLLM's own size, 2 x SEQS x (1 + MTP) at most {DEFAULT_GRAPH_CAP}")
    fix = (f"max_cudagraph_capture_size {cover:,} in that config covers them" if source == "flags" else
           f"GRAPH_TOKENS={cover:,} covers them")
    return ("warn", f"a long prompt's {p['largest_piece_tokens']:,}-token piece beside SEQS={s['SEQS']} streams of "
                    f"1 + MTP={s['MTP']} tokens makes a {step:,}-token step, above the largest CUDA graph ({graphs:,}: "
                    f"{whose}): those steps run outside graphs, ~2.3x as long at 32 layers on an H100 "
                    f"(benchmarks/latency48-h100 run2); {fix}")
