"""flash_cli.geometry: the model's shape read from a config.json (what the planner sizes from)."""

import json

import pytest

from flash_cli import geometry


@pytest.mark.parametrize("base", [1_000, 123_457, 2_000_000, 2_000_136, 7_654_321])
def test_a_reduced_or_foreign_ngram_base_sizes_the_table_from_the_config(tmp_path, base):
    # the bench's reduced tables (2,000,000) and checkpoints with other n-gram parameters: the plan's
    # table is what the plugin's layout makes of the config, not the real 320,001,536 rows
    from flash_vllm.ple.hashing import PLELayout
    text = {"vocab_size": 1000, "eos_token_id": 1, "ple_embed_dim": 2560, "ngram_size": 3, "heads_per_ngram": 8,
            "ngram_vocab_size_base": base, "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 128}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    g = geometry.from_config(tmp_path / "config.json")
    exact = PLELayout.from_config(text).num_rows
    assert g.ple_table_rows % 128 == 0 and g.ple_table_rows <= exact
    assert exact - g.ple_table_rows <= 16 * 200 + 128  # 16 heads' prime gaps above the base, and the padding
    assert g.ple_table_bytes == g.ple_table_rows * 160


def test_the_real_ngram_base_keeps_the_verified_row_count(tmp_path):
    text = {"ngram_vocab_size_base": 20_000_000, "ngram_size": 3, "heads_per_ngram": 8}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    assert geometry.from_config(tmp_path / "config.json").ple_table_rows == 320_001_536 == geometry.REAL.ple_table_rows
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"ngram_vocab_size_base": True}}))
    assert geometry.from_config(tmp_path / "config.json").ple_table_rows == 320_001_536
