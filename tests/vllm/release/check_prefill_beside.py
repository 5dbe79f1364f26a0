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

import pytest

from check_prefix_hits import _model, rendered
from prefix_sim import Sim

LONG = 32_768
BLOCK = 1_600
SHARED = 800  # profiles/shared.env's threshold


@pytest.fixture(scope="module")
def runs(serve_cli, base, registered):
    """{name: (the parsed threshold, Sim.beside's result)} for default, shared, shared at the old 1,024,
    and shared's prompt alone."""
    out = {}
    for name, profile, words, stream in (("default", "default", {}, 64), ("shared", "shared", {}, 64),
                                         ("shared-1024", "shared", {"EXTRA": "--long-prefill-token-threshold 1024"}, 64),
                                         ("shared-alone", "shared", {}, 0)):
        _, _, settings = rendered(serve_cli, base, profile, **words)
        sim = Sim(_model(), settings)
        assert sim.block_size == BLOCK, sim.block_size  # the recipe's block: what the alignment is to
        out[name] = (settings.long_prefill, sim.beside(stream, LONG))
    return out


def test_the_stream_gets_a_token_in_every_step_of_the_prefill(runs):
    """Running requests are scheduled before a new prompt's chunk takes the rest of the budget: no
    step of the prefill leaves the decoding stream out, in either profile."""
    for name in ("default", "shared", "shared-1024"):
        _, got = runs[name]
        assert got["stalls"] == 0 and all(t >= 1 for t in got["stream_tokens"]), (name, got["stream_tokens"])


def test_default_shares_four_steps_with_block_aligned_8000_token_chunks(runs):
    """default: no threshold; the 8,192-token budget less the stream's token, cut back to the block."""
    threshold, got = runs["default"]
    assert threshold == 0
    chunks = got["chunks"]
    assert all(c % BLOCK == 0 and c <= 8192 for c in chunks[:-1]), chunks
    assert max(chunks) == 5 * BLOCK and len(chunks) == 5, chunks


def test_shared_cuts_the_prefill_into_800_token_steps(runs):
    threshold, got = runs["shared"]
    assert threshold == SHARED  # the profile's EXTRA, parsed by this release
    chunks = got["chunks"]
    assert chunks[:-1] == [SHARED] * (len(chunks) - 1) and 0 < chunks[-1] <= SHARED, chunks
    assert len(chunks) == math.ceil(LONG / SHARED) == 41


def test_1024_was_no_fewer_steps_than_800_and_carried_more_tokens_in_half_of_them(runs):
    """Why shared's value changed: a threshold that does not divide the block re-aligns every other
    chunk (1,024 + 576 = one block), so 1,024 took as many steps as 800 and put 224 more tokens in
    half of them; a stream's worst gaps come from those."""
    _, old = runs["shared-1024"]
    _, new = runs["shared"]
    assert old["chunks"][:4] == [1024, BLOCK - 1024, 1024, BLOCK - 1024], old["chunks"][:6]
    assert len(old["chunks"]) == len(new["chunks"]) and max(old["chunks"]) > max(new["chunks"])


def test_shared_alone(runs):
    """One user's long prompt under shared: vLLM 0.31+ lifts the threshold when no other request is
    eligible (the whole budget: default's chunks); 0.29 and 0.30 chunk it all the same (41 steps)."""
    import vllm

    _, alone = runs["shared-alone"]
    _, default = runs["default"]
    if tuple(int(x) for x in vllm.__version__.split(".")[:2]) >= (0, 31):
        assert alone["chunks"] == default["chunks"], (alone["chunks"], default["chunks"])
    else:
        assert len(alone["chunks"]) == 41, alone["chunks"]
