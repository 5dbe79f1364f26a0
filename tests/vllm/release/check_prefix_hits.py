"""Issue 33 item 2: which prompts hit the prefix cache, as flash renders the recipe, asked of this
release's own scheduler (prefix_sim.py: the real Scheduler over the real 48-layer KV layout, with
flash_vllm registered, since patch 4 is a scheduler patch).

The settings are not typed in here: the default profile is rendered for this release's base
(PREFIX_RETAIN=0 and =dense; MTP_BLOCK_DROP=0 where the base takes it), parsed by the release's
`vllm serve` parser, and the parsed values (chunk size, MTP depth and block drop, KV dtype,
retention) are what the scheduler is built with.

What users reported (shared prefixes under ~8k tokens never hit) is a scheduler fact here: in
"align" mode a Mamba state exists only where a prefill chunk ended, and vLLM's default retention
keeps only a prompt's last boundary and the junctions it has seen. docs/PREFIX-CACHE.md has the
whole table; these assertions are the claims that page makes.
"""

from __future__ import annotations

import os

import pytest

from prefix_sim import Settings, Sim, shared_prefix

SHORT, LONG = 32, 2000       # a question after a shared document; a user's own document after a shared prompt
UNDER, PAST = 2048, 9600     # a prefix inside one 8,192-token prefill chunk; one past it
CHUNK_END = 8000             # the 8,192-token chunk cut back to the 1,600-token block (5 blocks)


def _model() -> str:
    paths = os.environ.get("FLASH_TEST_TINY_MODELS", "")
    if not paths:
        pytest.fail("FLASH_TEST_TINY_MODELS is not set: tests/vllm/test_releases.py passes the tiny snapshots")
    return paths.split(os.pathsep)[0]  # its config only: the layout is the real model's


def rendered(serve_cli, base: str, profile: str = "default", **overrides: str):
    """A profile for this base → (flash's resolved settings, its argv, the sim's settings parsed from
    that argv by this release's parser)."""
    import json

    from flash_cli import profiles, spec
    from flash_cli.settings import resolve

    s = resolve(profiles.load(profile).layer(), {}, {"BASE": base, **overrides}, profile_name=profile)
    argv = spec.vllm_args(s, "0" * 40, "127.0.0.1", 18300)
    a = serve_cli.parser.parse_args(argv[2:])
    serve_cli.validate(a)
    sc = a.speculative_config
    sc = json.loads(sc) if isinstance(sc, str) else (sc or {})
    retention = a.prefix_cache_retention_interval
    if retention is not None and not isinstance(retention, int):  # 0.29's UNSET: the field's default factory
        from vllm.config import CacheConfig

        retention = CacheConfig().prefix_cache_retention_interval
    return s, argv, Settings(mtp=int(sc.get("num_speculative_tokens", 0)), kv_dtype=a.kv_cache_dtype,
                             batched_tokens=a.max_num_batched_tokens, retention=retention,
                             long_prefill=a.long_prefill_token_threshold or 0,
                             block_drop=not sc.get("disable_eagle_block_drop", False))


VARIANTS = {"0": {}, "dense": {"PREFIX_RETAIN": "dense"}, "keep": {"MTP_BLOCK_DROP": "0"}}


@pytest.fixture(scope="module")
def sims(serve_cli, base, registered):
    """{variant: (its settings resolved by flash, a Sim built from its parsed argv)}: PREFIX_RETAIN 0
    (the default) and dense, MTP_BLOCK_DROP=0 where the base takes it (flash refuses it elsewhere)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from flash_common import releases

    assert getattr(Scheduler._mamba_block_aligned_split, "__flash_patch__", None) == 4  # the recipe's scheduler
    out = {}
    for variant, words in VARIANTS.items():
        if variant == "keep" and not releases.has(base, "spec_eagle_block_drop_flag"):
            continue
        flash, _, settings = rendered(serve_cli, base, **words)
        out[variant] = (flash, Sim(_model(), settings))
    return out


@pytest.fixture(scope="module")
def hits(sims):
    """{variant: {(prefix, tail): [hit tokens of the 1st, 2nd, 3rd prompt]}}, the block, the cache block."""
    out = {variant: {(p, t): [r.hit_tokens for r in shared_prefix(sim, p, t)] for p in (UNDER, PAST)
                     for t in (SHORT, LONG)} for variant, (_, sim) in sims.items()}
    sim = sims["0"][1]
    return out, sim.block_size, sim.cache_block_size


def test_retain_renders_to_what_vllm_reads(serve_cli, base):
    """0 leaves the release's default (0: semantic checkpoints only); dense reaches vLLM as None."""
    from vllm.config import CacheConfig

    _, argv0, s0 = rendered(serve_cli, base)
    assert "--prefix-cache-retention-interval" not in argv0  # the proven argv is unchanged
    assert s0.retention == CacheConfig().prefix_cache_retention_interval == 0
    _, argv, dense = rendered(serve_cli, base, PREFIX_RETAIN="dense")
    assert argv[argv.index("--prefix-cache-retention-interval") + 1] == "None"
    assert dense.retention is None
    assert (s0.mtp, s0.batched_tokens, s0.kv_dtype) == (2, 8192, "auto")  # the chunk the numbers below assume


def test_hits_land_on_blocks_inside_the_shared_part(hits, base):
    """Whatever the release: a hit is whole blocks, never past the shared prefix, none on a cold prompt.
    The scheduler ran with the cache block the release's engine core sets: the 1,600-token block, but
    on 0.29 the QSA ring's 8 tokens (every group counted), the case patch 4 corrects."""
    table, block, cache_block = hits
    assert block == 1600
    assert cache_block == (8 if base == "v0.29" else block)
    for retain, rows in table.items():
        for (prefix, tail), got in rows.items():
            assert got[0] == 0, (retain, prefix, tail, got)
            assert all(h % block == 0 and h <= prefix for h in got), (retain, prefix, tail, got)


def test_default_misses_the_second_prompt_past_a_block_of_its_own(hits):
    """The users' report, as vLLM's scheduler decides it: two prompts sharing a prefix, then a tail of
    their own longer than a block: the second gets nothing back, at any prefix length; the third hits
    (the second stopped its prefill at the junction it found)."""
    table, _, _ = hits
    for prefix in (UNDER, PAST):
        assert table["0"][(prefix, LONG)][1] == 0, table["0"]
    assert table["0"][(PAST, LONG)][2] == CHUNK_END


def test_dense_gives_the_second_prompt_the_chunk_end(hits):
    """PREFIX_RETAIN=dense: the state the first prompt's first chunk ended on is kept, so the second
    hits 8,000 tokens past one chunk, whatever its tail; it never hits less than the default."""
    table, _, _ = hits
    for tail in (SHORT, LONG):
        assert table["dense"][(PAST, tail)][1] == CHUNK_END, table["dense"]
    for key, got in table["0"].items():
        assert all(d >= z for d, z in zip(table["dense"][key], got)), (key, got, table["dense"][key])


def test_v033_hits_from_the_first_block_on(hits, base):
    """On 0.33 (the default base) a prefix of two blocks' worth hits its first block: at once when the
    tails are short, from the third prompt when they are long. (0.29-0.32 keep one block back: their
    MTP drafter drops the last matched block, which 0.33's hash lookahead made unnecessary.)"""
    if base != "v0.33":
        table, _, _ = hits
        assert table["0"][(UNDER, LONG)] == [0, 0, 0], table["0"]
        return
    table, block, _ = hits
    assert table["0"][(UNDER, SHORT)] == [0, block, block]
    assert table["0"][(UNDER, LONG)] == [0, 0, block]


def test_keeping_the_drafters_block_gives_it_back(hits, base):
    """MTP_BLOCK_DROP=0 (0.30+): on 0.30-0.32, where the drafter drops the last matched block, keeping
    it gives the short-tail second prompt its first block, as 0.33 has without it; never fewer hits."""
    table, block, _ = hits
    if "keep" not in table:
        assert base == "v0.29"
        return
    for key, got in table["0"].items():
        assert all(k >= z for k, z in zip(table["keep"][key], got)), (key, got, table["keep"][key])
    assert table["keep"][(UNDER, SHORT)] == [0, block, block], table["keep"]


def test_flash_plan_says_where_hits_start(sims):
    """`flash plan`'s prefix-cache line (flash_cli/plan/prefix.py) against this release's scheduler, at
    its own thresholds: the third prompt sharing a prefix misses one token short of `first_hit_tokens`
    and hits at it, short tails or long; with dense and long tails the second prompt hits the chunk
    end from `dense_second_hit_from_tokens` on and not one token before."""
    from flash_cli.plan import prefix as plan_prefix

    for variant, (flash, sim) in sims.items():
        p = plan_prefix.plan(flash, sim.block_size)
        first = p["first_hit_tokens"]
        for tail in (SHORT, LONG):
            assert shared_prefix(sim, first - 1, tail)[2].hit_tokens == 0, (variant, tail, p)
            assert shared_prefix(sim, first, tail)[2].hit_tokens > 0, (variant, tail, p)
        if variant == "dense":
            at = p["dense_second_hit_from_tokens"]
            assert shared_prefix(sim, at - 1, LONG)[1].hit_tokens < p["chunk_end_tokens"], p
            assert shared_prefix(sim, at, LONG)[1].hit_tokens == p["chunk_end_tokens"], p


def test_catalogue_knows_whether_the_drafter_drops_a_block(sims, base):
    """flash_common.releases' `mtp_hash_lookahead` (what the plan reads) is what this release's own
    scheduler does with MTP on: hash one token ahead and keep the block, or drop the block."""
    from flash_common import releases

    sched = sims["0"][1].scheduler
    lookahead = bool(getattr(sched, "num_hash_lookahead_tokens", 0))
    assert releases.has(base, "mtp_hash_lookahead") is lookahead
    drop = getattr(sched, "use_eagle_block_drop", None)
    drop = sched.use_eagle if drop is None else drop  # 0.29: the drafter's drop is use_eagle itself
    assert drop is not lookahead
