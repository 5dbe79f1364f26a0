"""Issue 33 item 2, the scheduler's half of "decode stalls while another client prefills": one stream
decoding while a fresh 32,768-token prompt arrives, asked of this release's own scheduler
(prefix_sim.py `Sim.beside`: the real Scheduler over the real 48-layer KV layout, flash_vllm
registered) with the `default` and `shared` profiles rendered for this release's base and parsed by
its `vllm serve` parser.

What it shows: whether the stream gets a token in every step (no step without it), and how many
prompt tokens share each of those steps, which is what sets the stream's inter-token gap while the
prefill runs (the GPU's time for a step of that many tokens: lab/bench_latency.py measures it). In
Mamba "align" mode a chunk that does not end the prompt must end on the 1,600-token block, so
`--long-prefill-token-threshold` 1,024 (shared's value until 2026-12-05) gave chunks of
1,024, 576, 1,024, 576, …: 41 steps for 32,768 tokens, the same count as 800-token chunks but
carrying up to 1,024. shared now takes 800, which divides the block. docs/PREFIX-CACHE.md, "A long
prefill beside a decoding stream".
"""

from __future__ import annotations

import math
import shlex
from typing import NamedTuple

import pytest

from check_prefix_hits import _model, rendered
from prefix_sim import Sim

LONG = 32_768
BLOCK = 1_600
SHARED = 800  # profiles/shared.env's threshold


# MTP=4 moves the block to 1,664 (the Mamba state page grows with the draft depth): 800 no longer divides it
CASES = (("default", "default", {}, 64), ("shared", "shared", {}, 64),
         ("shared-1024", "shared", {"LONG_PREFILL": "1024"}, 64), ("shared-alone", "shared", {}, 0),
         ("shared-mtp4", "shared", {"MTP": "4"}, 64))


class Run(NamedTuple):
    threshold: int  # --long-prefill-token-threshold as this release parsed it
    got: dict       # Sim.beside's result
    block: int      # the scheduler's block
    flash: object   # flash's resolved settings


@pytest.fixture(scope="module")
def runs(serve_cli, base, registered):
    """{name: Run} for default, shared, shared at the old 1,024, shared's prompt alone, and shared
    with MTP=4."""
    out = {}
    for name, profile, words, stream in CASES:
        flash, _, settings = rendered(serve_cli, base, profile, **words)
        sim = Sim(_model(), settings)
        if "MTP" not in words:
            assert sim.block_size == BLOCK, sim.block_size  # the recipe's block: what the alignment is to
        out[name] = Run(settings.long_prefill, sim.beside(stream, LONG), sim.block_size, flash)
    return out


def test_the_stream_gets_a_token_in_every_step_of_the_prefill(runs):
    """Running requests are scheduled before a new prompt's chunk takes the rest of the budget: no
    step of the prefill leaves the decoding stream out, in either profile."""
    for name in ("default", "shared", "shared-1024"):
        got = runs[name].got
        assert got["stalls"] == 0 and all(t >= 1 for t in got["stream_tokens"]), (name, got["stream_tokens"])


def test_default_shares_four_steps_with_block_aligned_8000_token_chunks(runs):
    """default: no threshold; the 8,192-token budget less the stream's token, cut back to the block."""
    threshold, got = runs["default"].threshold, runs["default"].got
    assert threshold == 0
    chunks = got["chunks"]
    assert all(c % BLOCK == 0 and c <= 8192 for c in chunks[:-1]), chunks
    assert max(chunks) == 5 * BLOCK and len(chunks) == 5, chunks


def test_shared_cuts_the_prefill_into_800_token_steps(runs):
    threshold, got = runs["shared"].threshold, runs["shared"].got
    assert threshold == SHARED  # the profile's LONG_PREFILL, rendered and parsed by this release
    chunks = got["chunks"]
    assert chunks[:-1] == [SHARED] * (len(chunks) - 1) and 0 < chunks[-1] <= SHARED, chunks
    assert len(chunks) == math.ceil(LONG / SHARED) == 41


def test_1024_was_no_fewer_steps_than_800_and_carried_more_tokens_in_half_of_them(runs):
    """Why shared's value changed: a threshold that does not divide the block re-aligns every other
    chunk (1,024 + 576 = one block), so 1,024 took as many steps as 800 and put 224 more tokens in
    half of them; a stream's worst gaps come from those."""
    old, new = runs["shared-1024"].got, runs["shared"].got
    assert old["chunks"][:4] == [1024, BLOCK - 1024, 1024, BLOCK - 1024], old["chunks"][:6]
    assert len(old["chunks"]) == len(new["chunks"]) and max(old["chunks"]) > max(new["chunks"])


def test_shared_alone(runs):
    """One user's long prompt under shared: vLLM 0.31+ lifts the threshold when no other request is
    eligible (the whole budget: default's chunks); 0.29 and 0.30 chunk it all the same (41 steps)."""
    import vllm

    alone, default = runs["shared-alone"].got, runs["default"].got
    if tuple(int(x) for x in vllm.__version__.split(".")[:2]) >= (0, 31):
        assert alone["chunks"] == default["chunks"], (alone["chunks"], default["chunks"])
    else:
        assert len(alone["chunks"]) == 41, alone["chunks"]


def test_flash_plan_names_the_block_and_the_pieces_this_scheduler_cuts(runs):
    """`flash plan`'s long_prefill section (plan/prefill.py over plan/kvcache.py's block) against this
    release's scheduler: the same block, and the prompt's chunks (all but the one that ends it) are
    the plan's pieces per block, over and over; where the threshold does not divide the block the
    plan's warning names the one that does."""
    from flash_cli.plan import build, prefill
    from flash_cli.plan.hardware import preset

    for name in ("shared", "shared-1024", "shared-mtp4"):
        threshold, got, block, flash = runs[name]
        plan = build(flash, preset("gb10"), snapshot=None, live_checks=False)
        assert plan["kv_layout"]["block_size"] == block, (name, plan["kv_layout"]["block_size"], block)
        lp = plan["long_prefill"]
        per = lp["pieces_per_block"]
        body = got["chunks"][:-1]
        whole = len(body) // len(per) * len(per)
        assert whole >= len(per) and body[:whole] == per * (whole // len(per)), (name, per, body[:8])
        even = lp["even_threshold_tokens"]
        assert block % even == 0 and (lp["even"] or prefill.finding(lp)[1].endswith(f"({block // even} pieces of {even:,})"))
    assert runs["shared-mtp4"].block % SHARED, "MTP=4's block is no longer a multiple of 800: this case shows nothing"


def _release_capture_sizes(serve_cli, argv: list[str]) -> list[int]:
    """The CUDA graph sizes this release captures for a rendered argv: its own
    `VllmConfig._set_cudagraph_sizes`, run over the parsed compilation config on the parsed scheduler
    and draft settings (the rest of a VllmConfig needs the model and a device)."""
    import json
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, VllmConfig

    a = serve_cli.parser.parse_args(argv[2:])
    cc = a.compilation_config
    cc = CompilationConfig(**cc) if isinstance(cc, dict) else cc
    sc = a.speculative_config
    sc = json.loads(sc) if isinstance(sc, str) else (sc or {})
    mtp = int(sc.get("num_speculative_tokens", 0))
    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=bool(a.enforce_eager)), compilation_config=cc,
        scheduler_config=SimpleNamespace(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens),
        parallel_config=SimpleNamespace(tensor_parallel_size=1), uniform_decode_query_len=1 + mtp,
        speculative_config=None, performance_mode="throughput")
    VllmConfig._set_cudagraph_sizes(config)
    return list(cc.cudagraph_capture_sizes)


GRAPH_CASES = (("shared", {}), ("shared", {"GRAPH_TOKENS": "0"}), ("shared", {"MTP": "4"}),
               ("shared", {"GRAPH_TOKENS": "830"}), ("shared", {"GRAPH_TOKENS": "9000"}), ("default", {}),
               ("default", {"SEQS": "256"}), ("default", {"SEQS": "5", "MTP": "0"}), ("default", {"SEQS": "1"}),
               # the compilation flags set it: COMPILE_FLAGS whole, and a dotted -cc key in EXTRA, which this
               # release's parser applies after flash's own JSON (replacing it whole)
               ("nvidia", {}), ("default", {"GRAPH_TOKENS": "0", "COMPILE_FLAGS": "-cc '{\"max_cudagraph_capture_size\":256}'"}),
               ("default", {"GRAPH_TOKENS": "0", "COMPILE_FLAGS": "-cc '{\"cudagraph_capture_sizes\":[1,2,4,8,100,9000]}'"}),
               ("shared", {"EXTRA": "-cc.max_cudagraph_capture_size=64"}),
               ("shared", {"EXTRA": "-cc.cudagraph_mode=FULL_AND_PIECEWISE"}))


def test_flash_plan_knows_the_largest_cuda_graph_this_release_captures(serve_cli, base):
    """plan/prefill.py `capture_max` (GRAPH_TOKENS, else vLLM's 2 x SEQS x (1 + MTP) at most 512, on its
    capture grid, capped by BATCHED_TOKENS) against this release's own sizing of the rendered argv; and
    shared's step beside every stream (800 + 8 x 3) inside it, which is what GRAPH_TOKENS=832 is for."""
    from flash_cli.plan import prefill

    for profile, words in GRAPH_CASES:
        flash, argv, _ = rendered(serve_cli, base, profile, **words)
        sizes = _release_capture_sizes(serve_cli, argv)
        extra = shlex.split(flash["EXTRA"] or "")
        assert prefill.capture_max(flash, extra) == max(sizes), (profile, words, sizes[-4:])
    flash, argv, _ = rendered(serve_cli, base, "shared")
    step = prefill.plan(flash, BLOCK)["step_beside_tokens"]
    assert step == SHARED + 8 * 3 and any(step <= n for n in _release_capture_sizes(serve_cli, argv))
