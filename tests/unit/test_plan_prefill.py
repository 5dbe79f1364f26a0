"""`flash plan`'s long-prefill section (flash_cli/plan/prefill.py) and LONG_PREFILL's rendering. The
vllm tier (check_prefill_beside.py) holds the same pieces to each release's scheduler."""

from __future__ import annotations

import json
import shlex

import pytest

from flash_cli import profiles, spec
from flash_cli.__main__ import main
from flash_cli.errors import ConfigError
from flash_cli.plan import prefill
from flash_cli.settings import resolve


def settings(profile: str = "shared", **words: str):
    return resolve(profiles.load(profile).layer(), {}, words, profile_name=profile)


@pytest.mark.parametrize("threshold, block, aligned, want", [
    (800, 1600, True, [800, 800]),
    (1024, 1600, True, [1024, 576]),             # shared's value until 2026-12-05
    (800, 1664, True, [800, 800, 64]),           # MTP=4's block
    (800, 3264, True, [800, 800, 800, 800, 64]),
    (1600, 1600, True, [1600]),
    (2000, 1600, True, [1600]),                  # cut back to whole blocks
    (4000, 1600, True, [3200]),
    (1024, 1600, False, [1024]),                 # no prefix caching: no alignment
])
def test_pieces(threshold, block, aligned, want):
    assert prefill.pieces(threshold, block, aligned) == want
    if aligned and threshold < block:
        assert sum(want) == block


@pytest.mark.parametrize("block, even", [(1600, 800), (1664, 832), (3264, 816), (3136, 784), (3200, 800),
                                         (256, 256), (1031, 1031 if 1031 <= 1024 else 1)])
def test_the_even_threshold_divides_the_block_and_is_the_largest_up_to_1024(block, even):
    got = prefill.divisor_at_most(block)
    assert got == even and block % got == 0
    assert not any(block % d == 0 for d in range(got + 1, min(block, prefill.PIECE_CAP) + 1))


def test_plan_section_and_finding():
    assert prefill.plan(settings("default"), 1600) is None  # LONG_PREFILL=0: vLLM's default
    p = prefill.plan(settings(), 1600)
    assert (p["threshold_tokens"], p["pieces_per_block"], p["even"]) == (800, [800, 800], True)
    assert prefill.finding(p) is None
    assert "pieces of 800, 800 tokens per 1,600-token block" in prefill.line(p)
    p = prefill.plan(settings(LONG_PREFILL="1024"), 1600)
    level, text = prefill.finding(p)
    assert level == "warn" and "LONG_PREFILL=1,024 does not divide the 1,600-token KV block" in text
    assert text.endswith("LONG_PREFILL=800 cuts the block evenly (2 pieces of 800)")
    level, text = prefill.finding(prefill.plan(settings(LONG_PREFILL="2000"), 1600))
    assert level == "info" and "pieces of 1,600" in text
    off = prefill.plan(settings(LONG_PREFILL="1024", PREFIX_CACHE="0"), 1600)
    assert off["pieces_per_block"] == [1024] and prefill.finding(off) is None


def test_flash_plan_warns_where_the_block_moves(capsys):
    """MTP=4 makes the block 1,664 (the Mamba state page grows with the draft depth): the plan shows
    800's pieces there and names 832."""
    assert main(["plan", "shared", "--hardware", "gb10", "MTP=4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["long_prefill"]["block_tokens"] == got["kv_layout"]["block_size"] == 1664
    warns = [f["text"] for f in got["findings"] if f["level"] == "warn" and "does not divide" in f["text"]]
    assert len(warns) == 1 and warns[0].endswith("LONG_PREFILL=832 cuts the block evenly (2 pieces of 832)")
    assert "pieces of 800, 800, 64" in warns[0]
    assert main(["plan", "shared", "--hardware", "gb10"]) == 0
    out = capsys.readouterr().out
    assert "  long prefill   LONG_PREFILL=800: a long prompt beside other requests goes in pieces of 800, 800" in out
    assert "does not divide" not in out


def test_rendering():
    argv = spec.vllm_args(settings(), "0" * 40, "127.0.0.1", 8000)
    i = argv.index("--long-prefill-token-threshold")
    assert argv[i + 1] == "800"
    assert "--long-prefill-token-threshold" not in spec.vllm_args(settings("default"), "0" * 40, "127.0.0.1", 8000)
    with pytest.raises(ConfigError) as err:
        spec.vllm_args(settings(CTX="4096", YARN="0", LONG_PREFILL="8192"), "0" * 40, "127.0.0.1", 8000)
    assert "LONG_PREFILL=8192 is above CTX=4096" in str(err.value)


@pytest.mark.parametrize("words, want", [
    ({}, 832),                                            # shared: GRAPH_TOKENS=832
    ({"GRAPH_TOKENS": "0"}, 48),                          # vLLM's own: 2 x 8 x 3
    ({"GRAPH_TOKENS": "0", "SEQS": "256"}, 512),          # ... at most 512
    ({"GRAPH_TOKENS": "0", "SEQS": "5", "MTP": "0"}, 8),   # 10 is off the grid: truncated to 8
    ({"GRAPH_TOKENS": "0", "SEQS": "1", "MTP": "2"}, 4),   # 6: the grid's 1, 2, 4
    ({"GRAPH_TOKENS": "830"}, 816),                       # off the 16-grid: truncated, as vLLM does
    ({"GRAPH_TOKENS": "9000"}, 8192),                     # BATCHED_TOKENS caps it and is captured itself
    ({"GRAPH_TOKENS": "0", "BATCHED_TOKENS": "300"}, 48),
    ({"GRAPH_TOKENS": "300", "BATCHED_TOKENS": "300"}, 300),
    # COMPILE_FLAGS replaces flash's flags: what vLLM's parser makes of them decides
    ({"COMPILE_FLAGS": "-cc.cudagraph_mode=PIECEWISE", "GRAPH_TOKENS": "0"}, 48),
    ({"COMPILE_FLAGS": "-cc '{\"max_cudagraph_capture_size\":256}'", "GRAPH_TOKENS": "0"}, 256),
    ({"COMPILE_FLAGS": "-cc '{\"cudagraph_capture_sizes\":[1,2,4,8,100,9000]}'", "GRAPH_TOKENS": "0"}, 100),
    ({"COMPILE_FLAGS": "-cc '{\"cudagraph_mode\":\"NONE\"}'", "GRAPH_TOKENS": "0"}, None),
    # EXTRA's dotted key: vLLM appends it after flash's JSON and it replaces that config whole, so
    # shared's GRAPH_TOKENS=832 is lost and this size is the one captured
    ({"EXTRA": "-cc.max_cudagraph_capture_size=64"}, 64),
    ({"EXTRA": "--compilation-config.cudagraph_mode=PIECEWISE"}, 48),
    ({"EXTRA": "--enforce-eager"}, None),
    ({"COMPILE_FLAGS": "-cc not-json", "GRAPH_TOKENS": "0"}, None),  # refused by the parser: no verdict
    ({"COMPILE_FLAGS": "-O0", "GRAPH_TOKENS": "0"}, None),            # -O0 without a mode: vLLM's NONE
    ({"COMPILE_FLAGS": "-O0 -cc.cudagraph_mode=PIECEWISE", "GRAPH_TOKENS": "0"}, 48),
    ({"COMPILE_FLAGS": "-O3"}, None),  # GRAPH_TOKENS (shared's 832) beside COMPILE_FLAGS: refused at build
])
def test_capture_max(words, want):
    """The largest CUDA graph vLLM captures (its `_set_cudagraph_sizes`; check_prefill_beside.py holds
    the same cases to each release's own function)."""
    s = settings(**words)
    assert prefill.capture_max(s, shlex.split(s["EXTRA"] or "")) == want


def test_a_piece_beside_every_stream_inside_or_outside_the_graphs(capsys):
    """shared's step (800 + 8 x 3 = 824) fits its 832 graphs; without GRAPH_TOKENS (vLLM's 48) or with
    MTP=4 (800 + 8 x 5 = 840) it does not, and `flash plan` says so and names the size that covers it."""
    p = prefill.plan(settings(), 1600)
    assert (p["step_beside_tokens"], p["graph_tokens"], p["in_graphs"]) == (824, 832, True)
    assert prefill.graph_finding(p, settings()) is None
    assert "a step beside every stream is 824 tokens, inside CUDA graphs (captured to 832)" in prefill.line(p)
    s = settings(GRAPH_TOKENS="0")
    level, text = prefill.graph_finding(prefill.plan(s, 1600), s)
    assert level == "warn" and "824-token step, above the largest CUDA graph (48: vLLM's own size" in text
    assert text.endswith("GRAPH_TOKENS=832 covers them")
    assert main(["plan", "shared", "--hardware", "gb10", "MTP=4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["long_prefill"]["step_beside_tokens"], got["long_prefill"]["in_graphs"]) == (840, False)
    warns = [f["text"] for f in got["findings"] if f["level"] == "warn"]
    assert any("840-token step, above the largest CUDA graph (832: GRAPH_TOKENS=832)" in w
               and w.endswith("GRAPH_TOKENS=848 covers them") for w in warns), warns
    s = settings(EXTRA="--enforce-eager")
    p = prefill.plan(s, 1600, ["--enforce-eager"])
    assert p["in_graphs"] is None and prefill.graph_finding(p, s) is None and "CUDA graphs" not in prefill.line(p)


@pytest.mark.parametrize("tokens, want", [(824, 832), (840, 848), (832, 832), (100, 104), (256, 256), (257, 272), (3, 8)])
def test_grid_up_is_on_vllms_grid_and_holds_the_tokens(tokens, want):
    got = prefill.grid_up(tokens)
    assert got == want and got >= tokens and prefill.grid_max(got) == got


def test_graphs_above_vllms_size_come_out_of_the_kv_pool():
    """GRAPH_TOKENS=832 against vLLM's own 48: the 0.77 GiB more graph memory latency48 run2 logged at the
    real shape comes out of the planned pool (its pool was 3.6% smaller); none without GRAPH_TOKENS, and a
    smaller shape's share follows its per-token activation bytes."""
    from dataclasses import replace

    from flash_cli.geometry import Geometry
    from flash_cli.plan import build, graph_extra_bytes
    from flash_cli.plan.hardware import preset

    shipped = build(settings(), preset("gb10"), snapshot=None, live_checks=False)
    without = build(settings(GRAPH_TOKENS="0"), preset("gb10"), snapshot=None, live_checks=False)
    assert shipped["budget"]["graphs_above_vllm_gib"] == pytest.approx(0.77, abs=0.005)
    assert without["budget"]["graphs_above_vllm_gib"] == 0.0
    drop = without["budget"]["kv_cache_gib"] - shipped["budget"]["kv_cache_gib"]
    assert drop == pytest.approx(0.77, abs=0.002)
    assert 0.03 < 1 - shipped["kv_cache_tokens"] / without["kv_cache_tokens"] < 0.05
    assert any("GRAPH_TOKENS=832: CUDA graphs captured to 832 tokens, above vLLM's own 48" in a
               for a in shipped["assumptions"])
    # at or under vLLM's own size nothing is added; a tiny shape gets a tiny share
    assert graph_extra_bytes(settings(GRAPH_TOKENS="48"), Geometry(), []) == 0
    tiny = replace(Geometry(), hidden_size=256, moe_intermediate_size=64, num_attention_heads=4, head_dim=64)
    assert 0 < graph_extra_bytes(settings(), tiny, []) < graph_extra_bytes(settings(), Geometry(), []) / 5


def test_a_capture_size_from_the_compilation_flags_is_read_checked_and_paid_for():
    """COMPILE_FLAGS (or a compilation config in EXTRA, which vLLM applies after flash's own) sets the
    capture size: the plan reads it as vLLM's parser would, warns naming the config to change (GRAPH_TOKENS
    cannot join COMPILE_FLAGS), and takes the graphs above vLLM's own size out of the pool."""
    from flash_cli.plan import build
    from flash_cli.plan.hardware import preset

    flags = "-cc '{\"max_cudagraph_capture_size\":256}'"
    s = settings(GRAPH_TOKENS="0", COMPILE_FLAGS=flags)
    p = prefill.plan(s, 1600)
    assert (p["graph_tokens"], p["graph_source"], p["in_graphs"]) == (256, "flags", False)
    level, text = prefill.graph_finding(p, s)
    assert "(256: the compilation config of COMPILE_FLAGS / EXTRA)" in text
    assert text.endswith("max_cudagraph_capture_size 832 in that config covers them")
    # EXTRA's dotted key replaces flash's JSON whole: shared's 832 is gone, vLLM's own 48 is left
    s = settings(EXTRA="-cc.cudagraph_mode=FULL_AND_PIECEWISE")
    p = prefill.plan(s, 1600, shlex.split(s["EXTRA"]))
    assert (p["graph_tokens"], p["graph_source"], p["in_graphs"]) == (48, "flags", False)
    # the same 832 set through the flags costs what GRAPH_TOKENS=832 costs
    via_flags = build(settings(GRAPH_TOKENS="0", COMPILE_FLAGS="-cc '{\"max_cudagraph_capture_size\":832}'"),
                      preset("gb10"), snapshot=None, live_checks=False)
    shipped = build(settings(), preset("gb10"), snapshot=None, live_checks=False)
    assert via_flags["budget"]["graphs_above_vllm_gib"] == shipped["budget"]["graphs_above_vllm_gib"] > 0.7
    assert any(a.startswith("the compilation flags: CUDA graphs captured to 832 tokens") for a in via_flags["assumptions"])
