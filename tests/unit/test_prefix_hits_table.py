"""lab/prefix_hits.py's table (docs/PREFIX-CACHE.md): the second and third prompt's hits per cell,
rows named by the settings their arguments carry."""

from __future__ import annotations

from lab import prefix_hits


def _row(args: str, hits: dict) -> dict:
    return {"vllm": "0.33.0", "args": args, "block_size": 1600,
            "rows": [{"prefix": p, "tail": t, "hits": h} for (p, t), h in hits.items()]}


def test_table_names_settings_and_shows_second_and_third_prompt():
    rows = [_row("--flash --retention 0", {(2048, 32): [0, 1600, 1600], (2048, 2000): [0, 0, 1600],
                                          (9600, 32): [0, 0, 8000], (9600, 2000): [0, 0, 8000]}),
            _row("--mtp 4 --kv-dtype fp8_e4m3 --batched-tokens 4096 --retention none",
                 {(2048, 32): [0, 0, 0], (2048, 2000): [0, 0, 0], (9600, 32): [0, 6528, 6528],
                  (9600, 2000): [0, 6528, 6528]})]
    lines = prefix_hits.table(rows).splitlines()
    assert lines[0] == "| vLLM | settings (block, tokens) | tail | 2,048 | 9,600 |"
    assert lines[2] == "| 0.33.0 | flash default, PREFIX_RETAIN=0 (1,600) | 32 | 1,600 / 1,600 | 0 / 8,000 |"
    assert lines[3] == "| 0.33.0 | flash default, PREFIX_RETAIN=0 (1,600) | 2,000 | 0 / 1,600 | 0 / 8,000 |"
    assert lines[4].startswith("| 0.33.0 | NVIDIA's settings, stock vLLM, retention dense (1,600) | 32 |")
    assert prefix_hits.name("--flash --retention 0 --keep-block").endswith("MTP_BLOCK_DROP=0")
    assert len(lines) == 2 + 2 * 2


def test_beside_table_pairs_each_setting_with_its_alone_run_and_folds_repeated_chunks():
    def row(args, steps, stalls, chunks, vllm="0.30.0"):
        return {"vllm": vllm, "args": args, "steps": steps, "stalls": stalls, "chunks": chunks}

    rows = [row("--flash --beside 32768", 5, 0, [8000] * 4 + [768]),
            row("--flash --beside 32768 --alone", 5, None, [8000] * 4 + [768]),
            row("--flash --long-prefill 1024 --beside 32768", 41, 0, [1024, 576] * 20 + [768]),
            row("--flash --long-prefill 1024 --beside 32768 --alone", 41, None, [1024, 576] * 20 + [768]),
            row("--mtp 4 --kv-dtype fp8_e4m3 --batched-tokens 4096 --beside 32768", 10, 0, [3264] * 9 + [3392], "0.33.0")]
    lines = prefix_hits.beside_table(rows).splitlines()
    assert lines[2] == "| 0.30.0 | flash default | 5 (0) | 8,000 ×4, 768 | 5 | 8,000 ×4, 768 |"
    assert lines[3] == ("| 0.30.0 | flash shared, 1,024 (before 2026-12-05) | 41 (0) | (1,024, 576) ×20, 768 | 41 | "
                        "(1,024, 576) ×20, 768 |")
    assert lines[4] == "| 0.33.0 | NVIDIA's settings, stock vLLM | 10 (0) | 3,264 ×9, 3,392 | – | – |"
    assert len(lines) == 5
