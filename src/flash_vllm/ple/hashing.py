"""Exact n-gram hashing of qwen4_exp's PLE ("Engram") table, in numpy.

Bit-identical to transformers' ``Qwen4ExpTextNGramEmbedding`` (tests/unit/test_ple_hashing.py runs
both): heads 0..7 hash bigrams, 8..15 trigrams; head h of PLE layer p has the (p*H+h+1)-th prime
>= ``ngram_vocab_size_base`` rows; three odd SplitMix64 multipliers; the context never reaches back
past an EOS. Computing ids from token ids alone lets the gather run before the forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007  # base_seed = seed + 10007 * ple_layer_index


def splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return (x ^ (x >> 31)) & _MASK64


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    r = math.isqrt(n)
    f = 3
    while f <= r:
        if n % f == 0:
            return False
        f += 2
    return True


def primes_from(start: int, count: int) -> list[int]:
    """The first ``count`` primes >= ``start``."""
    out: list[int] = []
    n = start
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return out


def _get(cfg, name, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


@dataclass(frozen=True)
class PLELayout:
    """Geometry of one PLE layer's table, derived from the model config."""

    vocab_size: int
    eos: int
    ngram_size: int
    heads_per_ngram: int
    head_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]
    multipliers: tuple[int, ...]
    num_rows: int  # padded to make_ngram_vocab_size_divisible_by
    rows_per_shard: int
    num_shards: int
    head_dim: int

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @classmethod
    def from_config(cls, config, ple_layer_index: int = 0) -> "PLELayout":
        """``config``: the model config (dict or object; ``text_config`` is used when present).

        ``ple_layer_index`` is the position of the layer in ``ple_layer_ids`` (0 for Flash-Next's
        only PLE layer). Every field transformers defaults is defaulted the same way, except
        ``split_ngram_parts`` which the real checkpoints always spell out (128; transformers: 512).
        """
        text = _get(config, "text_config") or config
        vocab = int(_get(text, "vocab_size"))
        eos = _get(text, "eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0]
        if eos is None:
            raise ValueError("config has no eos_token_id (PLE hashing segments on EOS)")
        ngram_size = int(_get(text, "ngram_size", 3))
        hpn = int(_get(text, "heads_per_ngram", 8))
        base = int(_get(text, "ngram_vocab_size_base", 20_000_000))
        div = int(_get(text, "make_ngram_vocab_size_divisible_by", 128))
        parts = int(_get(text, "split_ngram_parts", 512))
        seed = int(_get(text, "seed", 1234))
        embed = _get(text, "ple_embed_dim") or _get(text, "hidden_size")
        if ngram_size < 2 or hpn < 1 or vocab < 1 or div < 1 or parts < 1:
            raise ValueError(
                f"bad PLE config: ngram_size={ngram_size} heads_per_ngram={hpn} vocab_size={vocab} "
                f"divisor={div} split_ngram_parts={parts}"
            )
        heads = (ngram_size - 1) * hpn
        if embed is None or int(embed) % heads:
            raise ValueError(f"ple_embed_dim {embed} is not divisible by {heads} n-gram heads")
        primes = primes_from(base, (ple_layer_index + 1) * heads)
        sizes = tuple(primes[ple_layer_index * heads :])
        offsets = []
        acc = 0
        for s in sizes:
            offsets.append(acc)
            acc += s
        num_rows = -(-acc // div) * div
        half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
        base_seed = seed + _LAYER_SEED_STRIDE * ple_layer_index
        mult = tuple(
            2 * (splitmix64((base_seed + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)
        )
        rps = -(-num_rows // parts)
        return cls(
            vocab_size=vocab,
            eos=int(eos),
            ngram_size=ngram_size,
            heads_per_ngram=hpn,
            head_sizes=sizes,
            head_offsets=tuple(offsets),
            multipliers=mult,
            num_rows=num_rows,
            rows_per_shard=rps,
            num_shards=-(-num_rows // rps),
            head_dim=int(embed) // heads,
        )

    def check_buffers(self, layer_multipliers, ngram_heads_offsets, ngram_heads_vocab_sizes) -> None:
        """Compare with the checkpoint's I64 buffers (``check_buffers(**table.buffers)``);
        ValueError naming the first mismatch."""
        for name, ours, theirs in (
            ("layer_multipliers", self.multipliers, layer_multipliers),
            ("ngram_heads_offsets", self.head_offsets, ngram_heads_offsets),
            ("ngram_heads_vocab_sizes", self.head_sizes, ngram_heads_vocab_sizes),
        ):
            theirs = tuple(int(v) for v in list(theirs))
            if theirs != tuple(ours):
                raise ValueError(f"checkpoint {name} {list(theirs)} != computed {list(ours)}")


def _hash_history(hist, seg_start, layout: PLELayout):
    """ids for every position of ``hist`` (int64), where position t's context may reach back to
    ``seg_start[t]`` (the first position of its request's history) but not past an EOS."""
    import numpy as np

    n = hist.shape[0]
    pos = np.arange(n, dtype=np.int64)
    eos_pos = np.where(hist == layout.eos, pos, -1)
    prev_eos = np.empty(n, dtype=np.int64)
    prev_eos[0] = -1
    if n > 1:
        np.maximum.accumulate(eos_pos[:-1], out=prev_eos[1:])
    lo = np.maximum(prev_eos + 1, seg_start)  # earliest position the context may read
    m = np.asarray(layout.multipliers, dtype=np.int64)
    eos = np.int64(layout.eos)
    mixed = hist * m[0]
    heads = []
    hpn = layout.heads_per_ngram
    sizes = np.asarray(layout.head_sizes, dtype=np.int64)
    offs = np.asarray(layout.head_offsets, dtype=np.int64)
    for k in range(1, layout.ngram_size):
        src = pos - k
        valid = src >= lo
        shifted = np.where(valid, hist[np.maximum(src, 0)], eos)
        mixed = mixed ^ (shifted * m[k])  # int64 wraps like torch; XOR keeps the bits
        a, b = (k - 1) * hpn, k * hpn
        heads.append(np.remainder(mixed[:, None], sizes[None, a:b]) + offs[None, a:b])
    return np.concatenate(heads, axis=1)


def ngram_ids(tokens, layout: PLELayout, context=None):
    """Global row ids ``int64 (T, num_heads)`` for one request's tokens.

    ``context``: the ``ngram_size-1`` ids before ``tokens`` (incremental decode / later prefill
    chunks); ``None`` means the start of the request (EOS-filled, like transformers without cache).
    """
    import numpy as np

    tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
    c = layout.ngram_size - 1
    ctx = np.full(c, layout.eos, np.int64) if context is None else np.asarray(context, np.int64).reshape(-1)
    if ctx.shape[0] != c:
        raise ValueError(f"context must hold {c} token ids, got {ctx.shape[0]}")
    hist = np.concatenate([ctx, tok])
    return _hash_history(hist, np.zeros(hist.shape[0], np.int64), layout)[c:]


def ngram_ids_batch(tokens, query_start_loc, layout: PLELayout, contexts=None):
    """Ids for a flat batch of requests (vLLM layout): request r owns
    ``tokens[query_start_loc[r]:query_start_loc[r+1]]``; ``contexts`` is ``(R, ngram_size-1)``
    (None = every request starts here). Returns ``int64 (len(tokens), num_heads)``."""
    import numpy as np

    tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
    qsl = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
    r = qsl.shape[0] - 1
    c = layout.ngram_size - 1
    if r < 0 or qsl[0] != 0 or qsl[-1] != tok.shape[0] or np.any(np.diff(qsl) < 0):
        raise ValueError(f"query_start_loc must rise from 0 to {tok.shape[0]}, got {qsl.tolist()[:8]}...")
    if contexts is None:
        ctx = np.full((r, c), layout.eos, np.int64)
    else:
        ctx = np.asarray(contexts, dtype=np.int64).reshape(r, c)
    lens = np.diff(qsl)
    # History: [ctx_0, tokens_0, ctx_1, tokens_1, ...]; request r's history starts at qsl[r] + c*r.
    starts = qsl[:-1] + c * np.arange(r, dtype=np.int64)
    n = tok.shape[0] + c * r
    is_tok = np.ones(n, dtype=bool)
    ctx_pos = (starts[:, None] + np.arange(c)[None, :]).reshape(-1)
    is_tok[ctx_pos] = False
    hist = np.empty(n, dtype=np.int64)
    hist[ctx_pos] = ctx.reshape(-1)
    hist[is_tok] = tok
    seg_start = np.repeat(starts, lens + c)
    return _hash_history(hist, seg_start, layout)[is_tok]
