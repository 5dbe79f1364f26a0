"""`flash plan`'s long-prefill section (flash_cli/plan/prefill.py) and LONG_PREFILL's rendering. The
vllm tier (check_prefill_beside.py) holds the same pieces to each release's scheduler."""

from __future__ import annotations

import json

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
    warns = [f["text"] for f in got["findings"] if f["level"] == "warn"]
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
