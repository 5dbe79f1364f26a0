"""Prompts of a wanted size in the server's own tokens.

`prompts.ledger_prompt` sizes its text by a words-per-token ratio measured with Qwen's tokenizer
(~1.41 tokens per ledger word). Another tokenizer can be far off: the tiny test model's 1,758-id
byte-level BPE makes ~3.5 tokens of a ledger word, so a "1,024-token" prompt was 2,605 tokens and
the server refused it (HTTP 400, max_model_len 2,048; the H200 run of issue 11). So a sized
prompt is measured with the server's tokenizer, vLLM's `POST /tokenize` ({"model", "prompt"} ->
{"count", "max_model_len", "tokens", ...}; vllm/entrypoints/serve/tokenize/ in 0.33.0; the count
is what /v1/completions charges for the same prompt, special tokens included), and the text is
scaled until the count fits. Where /tokenize is absent (a proxy forwarding only /v1/*) the
estimate is used, and the note says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import prompts as P

# stop scaling once the measured count is within this share below the goal
CLOSE_ENOUGH = 0.95
MAX_TRIES = 8


@dataclass(frozen=True)
class Sized:
    prompt: str
    tokens: int                  # measured with the server's tokenizer, or the estimate
    measured: bool
    goal: int                    # the token count aimed at (target, capped by max_model_len - completion)
    tries: int                   # /tokenize calls made
    server_max_model_len: int | None = None
    why_estimate: str = ""       # why the count is an estimate (the /tokenize reply)

    @property
    def note(self) -> str:
        if self.measured:
            return (f"prompt {self.tokens:,} tokens measured by the server's /tokenize "
                    f"(goal {self.goal:,}, {self.tries} tokenize call{'s' if self.tries != 1 else ''})")
        return (f"prompt ~{self.tokens:,} tokens by estimate ({P.TOKENS_PER_WORD} tokens/word, Qwen's tokenizer), "
                f"NOT measured: /tokenize {self.why_estimate}")

    def as_data(self) -> dict:
        return {"prompt_tokens_sized": self.tokens, "prompt_sizing": "tokenize" if self.measured else "estimate",
                "prompt_goal_tokens": self.goal, "tokenize_calls": self.tries,
                **({"tokenize_unavailable": self.why_estimate} if not self.measured else {})}


def count_tokens(client, model: str | None, text: str) -> tuple[int | None, int | None, str]:
    """(count, max_model_len, "") from the server's /tokenize, or (None, None, why) when it cannot."""
    reply = client.post("/tokenize", {"model": model, "prompt": text}, timeout=120)
    if reply.status != 200:
        return None, None, reply.why()
    body = reply.body if isinstance(reply.body, dict) else {}
    n, mml = body.get("count"), body.get("max_model_len")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None, None, f"HTTP 200 without an integer 'count' ({reply.text[:120]!r})"
    return n, (mml if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0 else None), ""


def ledger(client, model: str | None, target: int, *, nonce: str = "", completion: int = 1) -> Sized:
    """A ledger prompt of at most `target` tokens (and at most the server's max_model_len - completion),
    as close below it as a few /tokenize calls get, measured; else the estimate, flagged.

    A shorter ledger is a prefix of a longer one, so the count grows with the word count: the
    search keeps a bracket (most words that fit, fewest that do not) and steps proportionally."""
    goal = max(1, target)
    words = P.ledger_words(goal)
    fit: tuple[int, int, str] | None = None    # (words, count, text): the most words that fit
    over: tuple[int, int, str] | None = None   # the fewest words that do not
    mml = None
    tries = 0
    while tries < MAX_TRIES:
        text = P.ledger_prompt(goal, nonce=nonce, words=words)
        n, got_mml, why = count_tokens(client, model, text)
        tries += 1
        if n is None:
            if tries == 1:
                return Sized(text, goal, False, goal, 0, None, why)
            break  # it answered before: keep what was measured
        if got_mml:
            mml = got_mml
            goal = max(1, min(goal, mml - completion))
        if n <= goal:
            if fit is None or words > fit[0]:
                fit = (words, n, text)
        elif over is None or words < over[0]:
            over = (words, n, text)
        if fit and fit[1] >= CLOSE_ENOUGH * goal and (over is None or fit[0] < over[0]):
            break
        nxt = max(1, int(words * goal / max(n, 1)))
        lo, hi = (fit[0] + 1 if fit else 1), (over[0] - 1 if over else None)
        if hi is not None and hi < lo:
            break  # bracket closed: fit is the longest that fits
        nxt = max(lo, nxt) if hi is None else min(max(lo, nxt), hi)
        if nxt == words:
            break
        words = nxt
    if fit is None:  # even one ledger word is too long: send the shortest measured; the server says why
        assert over is not None
        return Sized(over[2], over[1], True, goal, tries, mml)
    return Sized(fit[2], fit[1], True, goal, tries, mml)
