"""`flash plan`'s prefix-cache section (flash_cli/plan/prefix.py): the thresholds per base and
setting. The vllm tier (check_prefix_hits.py) runs each release's scheduler at these thresholds."""

from __future__ import annotations

import json

import pytest

from flash_cli import profiles
from flash_cli.__main__ import main
from flash_cli.plan import prefix
from flash_cli.settings import resolve


def settings(**words: str):
    return resolve(profiles.load("default").layer(), {}, words, profile_name="default")


@pytest.mark.parametrize("words, first, drops, dense_from", [
    ({}, 1601, False, 8001),                                   # 0.33: the hash lookahead's extra token
    ({"BASE": "v0.32"}, 3200, True, 9600),                     # the drafter drops the last matched block
    ({"BASE": "v0.32", "MTP_BLOCK_DROP": "0"}, 1600, False, 8000),
    ({"MTP_BLOCK_DROP": "0"}, 1600, False, 8000),
    ({"MTP": "0"}, 1600, False, 8000),
    ({"BATCHED_TOKENS": "4096"}, 1601, False, 3201),
])
def test_thresholds(words, first, drops, dense_from):
    p = prefix.plan(settings(**words), 1600)
    assert (p["first_hit_tokens"], p["drafter_drops_block"], p["dense_second_hit_from_tokens"]) == (first, drops, dense_from)
    assert p["chunk_end_tokens"] == int(words.get("BATCHED_TOKENS", 8192)) // 1600 * 1600
    assert p["retain"] == "0"


def test_line_says_what_the_second_prompt_gets():
    line = prefix.line(prefix.plan(settings(), 1600))
    assert "hits in 1,600-token blocks, from a shared prefix of 1,601 tokens on" in line
    assert "gets nothing, the next such prompt hits (PREFIX_RETAIN=dense: 8,000 of them once the shared prefix " \
           "reaches 8,001 tokens)" in line
    dense = prefix.line(prefix.plan(settings(PREFIX_RETAIN="dense", BASE="v0.32"), 1600))
    assert "gets 8,000 of them once the shared prefix reaches 9,600 tokens (PREFIX_RETAIN=dense)" in dense
    assert "MTP_BLOCK_DROP=0 keeps it" in dense
    assert prefix.plan(settings(PREFIX_CACHE="0"), 1600) is None


def test_flash_plan_prints_and_returns_it(capsys):
    assert main(["plan", "default", "--hardware", "gb10", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["prefix_cache"]["block_tokens"] == got["kv_layout"]["block_size"] == 1600
    assert main(["plan", "default", "--hardware", "gb10"]) == 0
    assert "  prefix cache   hits in 1,600-token blocks" in capsys.readouterr().out
