"""Exactness: fixed token-id prompts answered greedily, their token ids saved, and a diff of two
such files that stops at the first token that differs."""

from __future__ import annotations

import json
from pathlib import Path


def greedy_cases(eos: int, vocab: int, seed: int = 7) -> list[tuple[str, list[int]]]:
    """Fixed token-id prompts: short ones, EOS inside (the n-gram context resets there), a long one
    (chunked prefill under a small --max-num-batched-tokens), the same long one again (a prefix-cache
    hit when caching is on) and one sharing its first 1,024 tokens."""
    import random

    rng = random.Random(seed)
    hi = min(vocab, 240_000)
    lo = min(1000, hi // 2)

    def ids(n):
        return [rng.randrange(lo, hi) for _ in range(n)]

    long = ids(3000)
    eos_in = ids(20)
    eos_in[5] = eos_in[12] = eos
    return [("short-1", ids(8)), ("short-2", ids(33)), ("eos-inside", eos_in), ("eos-last", ids(15) + [eos]),
            ("long", long), ("long-again", list(long)), ("shared-prefix", long[:1024] + ids(200))]


def greedy_cmd(args) -> int:
    import requests

    url = args.url.rstrip("/")
    model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    out = {"url": url, "model": model, "max_tokens": args.tokens, "cases": []}
    for name, prompt in greedy_cases(args.eos, args.vocab):
        body = {"model": model, "prompt": prompt, "max_tokens": args.tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        r = requests.post(url + "/v1/completions", json=body, timeout=600)
        if r.status_code != 200:
            raise SystemExit(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
        choice = r.json()["choices"][0]
        if choice.get("token_ids") is None:
            raise SystemExit(f"{name}: the server returned no token_ids (return_token_ids unsupported?)")
        out["cases"].append({"name": name, "prompt_len": len(prompt), "token_ids": choice["token_ids"]})
        print(f"{name}: {len(prompt)} prompt tokens -> {choice['token_ids'][:8]}...", flush=True)
    Path(args.out).write_text(json.dumps(out))
    return 0


def greedy_diff(args) -> int:
    a, b = (json.loads(Path(f).read_text()) for f in (args.a, args.b))
    if [c["name"] for c in a["cases"]] != [c["name"] for c in b["cases"]]:
        raise SystemExit("the two files hold different cases")
    for ca, cb in zip(a["cases"], b["cases"]):
        for i, (x, y) in enumerate(zip(ca["token_ids"], cb["token_ids"])):
            if x != y:
                print(f"DIFFER {ca['name']}: token {i}: {x} vs {y}")
                return 1
        if len(ca["token_ids"]) != len(cb["token_ids"]):
            print(f"DIFFER {ca['name']}: {len(ca['token_ids'])} vs {len(cb['token_ids'])} tokens")
            return 1
    print(f"identical: {len(a['cases'])} cases, {sum(len(c['token_ids']) for c in a['cases'])} tokens")
    return 0
