"""What the gpu-e2e tier sends to reach patch 3's and patch 13's triggers, and how it reads the answers.

Standard library only: fleet.py (on the device, in its own Python) and the vllm tier (CPU, inside a
release venv: tests/vllm/test_gpu_e2e_triggers.py) import the same request bodies and the same
judges, so what the CPU proved is what the GPU run sends.

Patch 13 (tool-marker guard). A random-weight model never writes a quoted `<tool_call>` by itself, so
the reply is forced with structured outputs. Two facts measured on vLLM 0.33.0's real code decide how:
- the server's parser engine runs in token-id mode (the chat server passes the output's token ids), in
  which `<tool_call>`/`</tool_call>` open and close a call only as their special token ids; the same
  characters spelled by ordinary tokens are content for stock vLLM too, so a text-only trigger proves
  nothing about `<tool_call>` (`<function=` is a text terminal and triggers either way);
- a `regex` is compiled with the special tokens filtered out (xgrammar's json/regex compiler), so it
  can only spell `<tool_call>` by pieces; in a Lark `grammar`, `<tool_call>` written bare (not quoted) is
  that special token and nothing else. xgrammar's request validator cannot resolve it without the
  tokenizer and rejects it, so the recipe's structured-outputs backend "auto" hands the request to
  guidance (llguidance, in the device payload), which forces exactly those ids.
So each case is a Lark grammar whose only sentence is the case's text, the markers as special tokens.
With tools in the request and tool_choice auto, the qwen3_coder parser adds no structural tag of its
own (no strict tools), so the grammar is the whole constraint; `enable_thinking: false` closes the
reasoning in the prompt, so the grammar binds from the first generated token. Measured on CPU with
the release's real request model, parser, backend selection and chat parse
(tests/vllm/test_gpu_e2e_triggers.py): stock 0.33.0 answers "Wrap it in `" with no tool call for the
quoted case and "Example:\n```" plus a get_weather call for the fenced one; patch 13 keeps both texts.

Patch 3 (Mamba state-copy guard). The injection (tests/gpu_e2e/inject/) corrupts one block-table entry
that a fused state copy reads, for one launch; PROMPT_SLACK/P3_MAX_TOKENS make a request cross a Mamba
block boundary during decode, the step at which vLLM's align mode copies state between block columns.
"""

from __future__ import annotations

import json
import re

# --- patch 13 ------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = "How do I ask for a tool call?"
# (name, the text the reply must be, where the special tokens go). `<tool_call>`/`</tool_call>` are the
# special tokens in the grammar (bare); everything else is a quoted Lark string.
P13_CASES = {
    "quoted": "Wrap it in `<tool_call>` tags.",
    "fenced": ("Example:\n```\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
               "</parameter>\n</function>\n</tool_call>\n```\nThat is the format."),
}
SPECIAL = ("<tool_call>", "</tool_call>")
MAX_TOKENS = 160  # the fenced text is ~90 tokens of the tiny BPE at worst


def _lark_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def lark_for(text: str) -> str:
    """A Lark grammar whose one sentence is `text`, each `<tool_call>`/`</tool_call>` as its special token."""
    parts = [p for p in re.split("(" + "|".join(map(re.escape, SPECIAL)) + ")", text) if p]
    return "start: " + " ".join(p if p in SPECIAL else _lark_string(p) for p in parts)


def p13_body(model: str, case: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS,
            "tool_choice": "auto", "structured_outputs": {"grammar": lark_for(P13_CASES[case])},
            "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}


def p13_verdict(case: str, message: dict) -> dict:
    """What one reply shows: the content kept the whole text (markers included) and no tool call came out."""
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    return {"content": content, "tool_calls": [(c.get("function") or {}).get("name") for c in calls],
            "content_is_text": content == P13_CASES[case], "no_tool_calls": not calls,
            "kept_as_text": content == P13_CASES[case] and not calls}


# --- patch 3 -------------------------------------------------------------------------------------

INJECT_ENV = "FLASH_E2E_INJECT"          # = "mamba-copy" on the servers that carry the injection
INJECT_KIND = "mamba-copy"
BAD_BLOCK_ID = 1 << 30                   # far past any pool: stock's copy addresses ~2^30 blocks away
INJECT_LINE = re.compile(r"FLASH_E2E_MAMBA_INJECT fired: (\{.*\})")
INJECT_REFUSED = re.compile(r"FLASH_E2E_MAMBA_INJECT refused: ([^\n]*)")
INJECT_READY = re.compile(r"FLASH_E2E_MAMBA_INJECT ready: ([^\n]*)")
GUARD_LINE = re.compile(r"mamba state-copy guard: (\d+) out-of-range")
PROMPT_SLACK = 24                        # the prompt ends this many tokens before a Mamba block boundary
P3_MAX_TOKENS = 96                       # ...and decoding runs past it (MTP steps of 1-3 tokens)
STOCK_DEATH = re.compile(r"illegal memory access|CUDA error|Xid|EngineDeadError|EngineCore[^\n]*(died|failed)|"
                         r"cudaErrorIllegalAddress|unspecified launch failure", re.I)


def fired(log: str) -> list[dict]:
    return [json.loads(m) for m in INJECT_LINE.findall(log)]


def guard_counts(log: str) -> list[int]:
    return [int(n) for n in GUARD_LINE.findall(log)]
