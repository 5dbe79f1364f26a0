"""The fixed prompts. Changing any of them changes every probe file and benchmark: don't, or
bump PROMPTS_VERSION so old results are not compared with new ones."""

from __future__ import annotations

import random

PROMPTS_VERSION = 1

# ~1.4 tokens per word for this vocabulary with Qwen's tokenizer (5,800 words ≈ 8k tokens upstream)
TOKENS_PER_WORD = 1.41
LEDGER_WORDS = ("invoice", "ledger", "balance", "credit", "debit", "account", "payable", "receivable",
                "accrual", "journal", "audit", "asset", "liability", "equity", "revenue", "expense")

COHERENCE_PROMPT = "The capital of France is"
COHERENCE_EXPECT = ("paris",)

DECODE_PROMPT = ("Explain in about 300 words how an operating system page cache works and why it matters "
                 "for a program that reads a large file at random offsets. /no_think")

DETERMINISM_PROMPT = "Write one paragraph about why deterministic greedy decoding matters for testing. /no_think"

TOOL_QUESTION = "What is the weather in Paris right now? Use the tool. /no_think"
TOOL_RESULT = '{"city": "Paris", "temperature_c": 18, "sky": "clear"}'
TOOL_EXPECT = ("18", "eighteen")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

# The greedy probe set (the gate behind layout changes such as the MTP graft): byte-identical text
# across two servers means every emitted token was the same argmax.
PROBE_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Write a haiku about the sea. /no_think",
    "Explain in about 200 words how an operating system page cache works. /no_think",
    "Write a Python function is_palindrome(s) with a docstring. /no_think",
    "Summarize Hamlet in four sentences. /no_think",
)


def ledger_words(tokens: int) -> int:
    """The ledger's word count for ~`tokens` tokens of Qwen's tokenizer (an estimate: gates/sizing.py
    measures with the server's own)."""
    return max(1, int(tokens / TOKENS_PER_WORD))


def ledger_prompt(tokens: int, nonce: str = "", seed: int = 1, words: int | None = None) -> str:
    """A deterministic ~`tokens`-token prompt (the upstream smoke test's shape: ledger words, 20%
    with a number) and a question. `nonce` goes FIRST so a new nonce shares no prefix block with
    any earlier prompt: the "cold" measurement is then really cold, run after run. `words` gives
    the ledger's length directly (the sizer's knob); the text for a word count never changes."""
    rng = random.Random(seed)
    count = ledger_words(tokens) if words is None else max(1, words)
    words_out = []
    for _ in range(count):
        w = rng.choice(LEDGER_WORDS)
        if rng.random() < 0.2:
            w += str(rng.randint(1, 9999))
        words_out.append(w)
    head = f"Session {nonce}. " if nonce else ""
    return (head + "Here is a ledger: " + " ".join(words_out)
            + "\n\nQuestion: which word appears most often in the ledger above? Answer with one word.")
