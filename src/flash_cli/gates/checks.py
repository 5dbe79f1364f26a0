"""`flash test`: the checks, each a function of a shared context that passes, fails or skips.

Check names are an interface (scripts and CI grep them): health, model, context, coherence,
effort, tool_call, prefill, prefix_cache, determinism, decode, metrics. They run in that order; a
later check may use what an earlier one measured (prefix_cache repeats prefill's prompt, or a longer
cold one of its own when the server's cache blocks, vllm:cache_config_info, are too large for
prefill's to show a hit; prefill is timed after an untimed warm-up of the same size, so a first
request's kernel compiles are not counted as prefill speed).

Prompts are sized to the server: the model check reads max_model_len from /v1/models and the
prefill (and so prefix_cache) and decode checks scale their token counts down to fit it, saying
so in their detail; the prefill prompt is then measured with the server's own tokenizer
(`POST /tokenize`, gates/sizing.py) and trimmed until it fits, the detail giving the measured count
(or, without /tokenize, saying the size is an estimate). A check can be declared not applicable (`n/a`, e.g. coherence on an
untrained checkpoint): it is reported as "n/a: REASON", counted apart, never silently dropped.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from . import metrics as M
from . import prompts as P
from . import sizing
from .client import Client, Reply

PASS, FAIL, SKIP, NA = "pass", "fail", "skip", "n/a"
CHECK_NAMES: tuple[str, ...] = ("health", "model", "context", "coherence", "effort", "tool_call", "prefill",
                                "prefix_cache", "determinism", "decode", "metrics")


@dataclass
class Thresholds:
    """The TEST_* settings (settings.py documents each)."""

    min_prefill_tps: float = 200.0
    min_decode_tps: float = 10.0
    prefill_tokens: int = 8192
    decode_tokens: int = 400
    det_runs: int = 3
    det_tokens: int = 32
    logprob_tol: float = 1e-6
    min_prefix_hit: float = 0.5

    @classmethod
    def from_settings(cls, s) -> "Thresholds":
        return cls(s["TEST_MIN_PREFILL_TPS"], s["TEST_MIN_DECODE_TPS"], s["TEST_PREFILL_TOKENS"],
                   s["TEST_DECODE_TOKENS"], s["TEST_DET_RUNS"], s["TEST_DET_TOKENS"], s["TEST_LOGPROB_TOL"],
                   s["TEST_MIN_PREFIX_HIT"])


@dataclass
class Result:
    name: str
    status: str
    detail: str
    required: bool = True
    seconds: float = 0.0
    data: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "required": self.required,
                "seconds": round(self.seconds, 3), **({"data": self.data} if self.data else {})}


@dataclass
class Context:
    client: Client
    thresholds: Thresholds = field(default_factory=Thresholds)
    expect_model: str | None = None
    expect_ple: str = "auto"  # auto | yes | no
    expect_ctx: int | None = None  # the recipe's max_model_len (None: no recipe known, context is N/A)
    ctx_source: str = ""
    model: str | None = None
    max_model_len: int | None = None  # what /v1/models reports (the model check fills it in)
    # filled in as checks run
    prefill: dict = field(default_factory=dict)
    healthy: bool = False
    generated: bool = False  # a generating check ran, so the token/request counters must have moved
    max_model_len: int | None = None  # from /v1/models (model check); prompts are sized to it
    not_applicable: dict[str, str] = field(default_factory=dict)  # check name -> why it does not apply


# Checks whose pass criterion needs a trained model (a random-weight test checkpoint cannot
# answer "Paris" nor call a tool on purpose); `flash test --untrained` declares them n/a.
NEEDS_TRAINED: dict[str, str] = {
    "coherence": "expects a trained model's answer ('Paris')",
    "tool_call": "expects a trained model to call the tool and use its result",
}

# Tokens kept free of the prompt: the completion, the prompt's question and, where the server has
# no /tokenize, the estimate's error (ledger_prompt sizes by a words-per-token ratio).
PROMPT_HEADROOM = 0.8
PROMPT_RESERVE = 64


def fit_tokens(ctx: Context, want: int, completion: int) -> tuple[int, str]:
    """(prompt tokens to send, a note when they were scaled down to the server's max_model_len)."""
    mml = ctx.max_model_len
    if not mml or want + completion + PROMPT_RESERVE <= mml * PROMPT_HEADROOM:
        return want, ""
    fitted = max(16, int(mml * PROMPT_HEADROOM) - completion - PROMPT_RESERVE)
    if fitted >= want:
        return want, ""
    return fitted, f"scaled from {want:,} to ~{fitted:,} tokens to fit max_model_len {mml:,}"


def _first_logprobs(body: dict) -> dict[str, float] | None:
    """First generated token's top logprobs from a /v1/completions reply."""
    try:
        tops = body["choices"][0]["logprobs"]["top_logprobs"]
        return dict(tops[0]) if tops else None
    except (KeyError, IndexError, TypeError):
        return None


def _logprob_delta(a: dict[str, float] | None, b: dict[str, float] | None) -> float:
    """Largest difference between two top-logprob maps; inf when the token sets differ."""
    if a is None or b is None or set(a) != set(b):
        return float("inf")
    return max((abs(a[k] - b[k]) for k in a), default=0.0)


def _text(body: dict) -> str:
    choice = body["choices"][0]
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("message") or {}).get("content") or ""


def _scrape(ctx: Context) -> tuple[M.Snapshot | None, str]:
    reply = ctx.client.get("/metrics", timeout=30)
    if reply.status != 200:
        return None, reply.why()
    try:
        return M.parse(reply.text), ""
    except M.MetricsError as exc:
        return None, str(exc)


# --- the checks -------------------------------------------------------------------------------
def check_health(ctx: Context) -> Result:
    reply = ctx.client.get("/health", timeout=10)
    if reply.status == 200:
        ctx.healthy = True
        return Result("health", PASS, f"/health 200 in {reply.seconds * 1000:.0f} ms")
    return Result("health", FAIL, f"/health: {reply.why()}",
                  data={"hint": "is the server up? flash status / flash logs"})


def check_model(ctx: Context) -> Result:
    reply = ctx.client.get("/v1/models", timeout=30)
    if reply.status == 401:
        return Result("model", FAIL, "/v1/models: HTTP 401 (the server requires an API key)",
                      data={"hint": "set VLLM_API_KEY or --api-key-file"})
    if not reply.ok:
        return Result("model", FAIL, f"/v1/models: {reply.why()}")
    ids = [m.get("id") for m in reply.body.get("data") or [] if isinstance(m, dict)]
    if not ids:
        return Result("model", FAIL, "/v1/models lists no model")
    if ctx.expect_model and ctx.expect_model not in ids:
        return Result("model", FAIL, f"expected model {ctx.expect_model!r}, server lists {ids}")
    ctx.model = ctx.expect_model or ids[0]
    mml = next((m.get("max_model_len") for m in reply.body["data"] if m.get("id") == ctx.model), None)
    ctx.max_model_len = mml if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0 else None
    return Result("model", PASS, f"{ctx.model}" + (f" (max_model_len {mml:,})" if isinstance(mml, int) else ""),
                  data={"models": ids, "max_model_len": mml})


def check_context(ctx: Context) -> Result:
    """The silent context fallback: a YaRN override that does not take leaves the server at the
    native 262,144 tokens while the recipe asked for more (seen only in the boot log)."""
    from ..bootlog import context_mismatch_hint

    if ctx.expect_ctx is None:
        return Result("context", SKIP, "N/A: no recipe to compare with (give one: flash test PROFILE [K=V…] --url URL; "
                      "the local container's labels carry it)")
    got = ctx.max_model_len
    if got is None:
        return Result("context", FAIL, f"/v1/models reports no max_model_len for {ctx.model!r} "
                      f"(the recipe asks for {ctx.expect_ctx:,})")
    if got != ctx.expect_ctx:
        return Result("context", FAIL, f"server max_model_len {got:,}, the recipe ({ctx.ctx_source}) asks for "
                      f"{ctx.expect_ctx:,}", data={"max_model_len": got, "expected": ctx.expect_ctx,
                                                   "hint": context_mismatch_hint(ctx.expect_ctx, got)})
    return Result("context", PASS, f"max_model_len {got:,} as the recipe ({ctx.ctx_source}) asks",
                  data={"max_model_len": got, "expected": ctx.expect_ctx})


def check_coherence(ctx: Context) -> Result:
    reply = ctx.client.post("/v1/completions", {"model": ctx.model, "prompt": P.COHERENCE_PROMPT,
                                                "max_tokens": 12, "temperature": 0})
    if not reply.ok:
        return Result("coherence", FAIL, f"/v1/completions: {reply.why()}")
    text = _text(reply.body)
    good = any(w in text.lower() for w in P.COHERENCE_EXPECT)
    return Result("coherence", PASS if good else FAIL,
                  f"{P.COHERENCE_PROMPT!r} -> {text!r}" + ("" if good else " (expected Paris)"), data={"text": text})


def check_effort(ctx: Context) -> Result:
    hint = "a 400 means the chat template rejects it: serve with EFFORT_ALIAS=1"
    chat = ctx.client.post("/v1/chat/completions", {
        "model": ctx.model, "messages": [{"role": "user", "content": "Say OK."}],
        "max_tokens": 1, "reasoning_effort": "high"})
    msgs = ctx.client.post("/v1/messages", {
        "model": ctx.model, "max_tokens": 1, "messages": [{"role": "user", "content": "Say OK."}],
        "output_config": {"effort": "high"}})
    parts, failed = [], False
    if chat.status == 200:
        parts.append("chat reasoning_effort=high: 200")
    else:
        failed = True
        parts.append(f"chat reasoning_effort=high: {chat.why()}")
    if msgs.status == 200:
        parts.append("/v1/messages output_config.effort=high: 200")
    elif msgs.status in (404, 405):
        parts.append(f"/v1/messages: HTTP {msgs.status} (endpoint absent on this server, skipped)")
    else:
        failed = True
        parts.append(f"/v1/messages effort=high: {msgs.why()}")
    detail = "; ".join(parts)
    if failed and 400 in (chat.status, msgs.status):
        detail += f" ({hint})"
    return Result("effort", FAIL if failed else PASS, detail)


def check_tool_call(ctx: Context) -> Result:
    question = [{"role": "user", "content": P.TOOL_QUESTION}]
    first = ctx.client.post("/v1/chat/completions", {
        "model": ctx.model, "messages": question, "tools": [P.WEATHER_TOOL], "tool_choice": "auto",
        "max_tokens": 256, "temperature": 0})
    if not first.ok:
        return Result("tool_call", FAIL, f"tool request: {first.why()}")
    message = first.body["choices"][0].get("message") or {}
    calls = message.get("tool_calls") or []
    if not calls:
        return Result("tool_call", FAIL, "no tool_calls in the reply (finish_reason "
                      f"{first.body['choices'][0].get('finish_reason')!r}, content {str(message.get('content'))[:80]!r}); "
                      "is the server started with --enable-auto-tool-choice --tool-call-parser?")
    fn = calls[0].get("function") or {}
    if fn.get("name") != "get_weather":
        return Result("tool_call", FAIL, f"called {fn.get('name')!r}, expected 'get_weather'")
    try:
        args = json.loads(fn.get("arguments") or "")
    except ValueError:
        return Result("tool_call", FAIL, f"arguments are not JSON: {fn.get('arguments')!r}")
    if not isinstance(args, dict) or not isinstance(args.get("city"), str) or not args["city"].strip():
        return Result("tool_call", FAIL, f"arguments lack the required 'city': {args!r}")
    round_trip = question + [
        {"role": "assistant", "content": message.get("content") or "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0].get("id", "call_0"), "content": P.TOOL_RESULT},
    ]
    second = ctx.client.post("/v1/chat/completions", {
        "model": ctx.model, "messages": round_trip, "tools": [P.WEATHER_TOOL], "max_tokens": 64, "temperature": 0})
    if not second.ok:
        return Result("tool_call", FAIL, f"call get_weather({args}) ok, but the tool result turn failed: {second.why()}")
    answer = _text(second.body)
    if not answer.strip():
        return Result("tool_call", FAIL, f"call get_weather({args}) ok, but the answer after the tool result is empty")
    if not any(w in answer.lower() for w in P.TOOL_EXPECT):
        return Result("tool_call", FAIL, f"the answer ignores the tool result (no '18'): {answer[:120]!r}")
    return Result("tool_call", PASS, f"get_weather({json.dumps(args)}) -> answer uses the result: {answer.strip()[:80]!r}",
                  data={"arguments": args})


def _one_token(ctx: Context, prompt: str) -> dict:
    """A greedy one-token /v1/completions body with the first token's top logprobs (prefill's and
    prefix_cache's cold requests; the repeat sends the same body)."""
    return {"model": ctx.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 3}


def _warm_up(ctx: Context, sized: sizing.Sized, nonce: str) -> Reply:
    """One untimed request of the same size that shares no prefix block (a new nonce goes first): the
    first prompt of a shape after a boot compiles kernels (vLLM 0.29, tiny model: 5.2 s for 1,020 tokens
    whose uncached repeat took 0.10 s, run41), which is not prefill speed."""
    prompt = sized.prompt.replace(f"Session {nonce}.", f"Session {uuid.uuid4().hex[:12]}.", 1)
    return ctx.client.post("/v1/completions", {"model": ctx.model, "prompt": prompt, "max_tokens": 1, "temperature": 0})


def check_prefill(ctx: Context) -> Result:
    th = ctx.thresholds
    tokens, scaled = fit_tokens(ctx, th.prefill_tokens, completion=1)
    nonce = uuid.uuid4().hex[:12]
    sized = sizing.ledger(ctx.client, ctx.model, tokens, nonce=nonce, completion=1)
    body = _one_token(ctx, sized.prompt)
    warm = _warm_up(ctx, sized, nonce)
    if not warm.ok:
        return Result("prefill", FAIL, f"/v1/completions warm-up ({sized.note}{'; ' + scaled if scaled else ''}): "
                      f"{warm.why()}", data=sized.as_data())
    reply = ctx.client.post("/v1/completions", body)
    if not reply.ok:
        return Result("prefill", FAIL, f"/v1/completions ({sized.note}{'; ' + scaled if scaled else ''}): "
                      f"{reply.why()}", data=sized.as_data())
    n = int((reply.body.get("usage") or {}).get("prompt_tokens") or 0)
    tps = n / reply.seconds if reply.seconds > 0 else 0.0
    ctx.prefill = {"body": body, "seconds": reply.seconds, "tokens": n, "first_logprobs": _first_logprobs(reply.body),
                   "text": _text(reply.body), "scaled": scaled, "sizing": sized.note}
    ok = tps >= th.min_prefill_tps
    return Result("prefill", PASS if ok else FAIL,
                  f"{n:,} tok in {reply.seconds:.2f} s => {tps:,.0f} tok/s prefill (cold cache; includes one decoded "
                  f"token; after an untimed warm-up of the same size, {warm.seconds:.2f} s)"
                  + (f"; prompt {scaled}" if scaled else "") + f"; {sized.note}"
                  + ("" if ok else f", below TEST_MIN_PREFILL_TPS={th.min_prefill_tps:g}"),
                  data={"prompt_tokens": n, "seconds": reply.seconds, "tok_s": tps, "warm_up_seconds": warm.seconds,
                        "requested_tokens": th.prefill_tokens,
                        **sized.as_data(), **({"scaled_to_max_model_len": ctx.max_model_len} if scaled else {})})


def cache_block(snap: M.Snapshot | None) -> int | None:
    """The prefix cache's granularity in tokens, from vllm:cache_config_info: a hit is whole KV blocks
    and, for a hybrid model caching Mamba state (mamba_cache_mode align/all), whole Mamba blocks, so
    the larger of block_size and mamba_block_size (vLLM 0.29 raised the tiny model's attention block
    to its Mamba block of 512 where 0.33 kept 256: run41). None when the server does not say."""
    sizes = []
    for labels in snap.labels_of("vllm:cache_config_info") if snap is not None else []:
        keys = ["block_size"] + ([] if labels.get("mamba_cache_mode", "").lower() == "none" else ["mamba_block_size"])
        for key in keys:
            try:
                sizes.append(int(labels.get(key) or 0))
            except ValueError:  # "None" on a model without Mamba layers
                pass
    sizes = [x for x in sizes if x > 0]
    return max(sizes) if sizes else None


def reachable_hit(tokens: int, block: int) -> int:
    """The prefix-cache hit a repeat of a `tokens`-token prompt can be expected to show at least: whole
    blocks short of the last token (one token is always computed), less one block that a server with
    a drafter (MTP/EAGLE) recomputes for the draft head's hidden states (drop_eagle_block)."""
    return max(0, (tokens - 1) // block - 1) * block


def hit_prompt_tokens(block: int, share: float) -> int:
    """A prompt goal whose reachable hit is at least `share` of it, with room for the sizer landing up to
    5% short (sizing.CLOSE_ENOUGH): k + 1/2 blocks, k the fewest that do it."""
    k = 2
    while reachable_hit(int(sizing.CLOSE_ENOUGH * (k + 0.5) * block), block) < share * (k + 0.5) * block and k < 64:
        k += 1
    return int((k + 0.5) * block)


def _cold_request(ctx: Context, tokens: int) -> tuple[dict, Reply, sizing.Sized]:
    sized = sizing.ledger(ctx.client, ctx.model, tokens, nonce=uuid.uuid4().hex[:12], completion=1)
    body = _one_token(ctx, sized.prompt)
    return body, ctx.client.post("/v1/completions", body), sized


def check_prefix_cache(ctx: Context) -> Result:
    th = ctx.thresholds
    if not ctx.prefill:  # prefill was not selected: send its cold request here first
        first = check_prefill(ctx)
        if not ctx.prefill:
            return Result("prefix_cache", FAIL, f"the first (cold) request failed: {first.detail}")
    before, why = _scrape(ctx)
    if before is not None and before.has("vllm:cache_config_info"):
        flags = {labels.get("enable_prefix_caching") for labels in before.labels_of("vllm:cache_config_info")}
        if flags == {"False"}:
            return Result("prefix_cache", SKIP, "prefix caching is off on this server (vllm:cache_config_info); "
                          "serve with PREFIX_CACHE=1 to test it")
    block = cache_block(before)
    resized = ""
    n = ctx.prefill["tokens"]
    if block and reachable_hit(n, block) < th.min_prefix_hit * n:
        # prefill's prompt is too short to show a hit in blocks this large: a cold prompt of its own
        goal = hit_prompt_tokens(block, th.min_prefix_hit)
        limit = (ctx.max_model_len or goal + 2) - 2
        if goal > limit:
            return Result("prefix_cache", SKIP, f"cannot show a hit: the prefix cache keeps blocks of {block:,} tokens "
                          f"(vllm:cache_config_info), a ~{goal:,}-token prompt is needed and max_model_len is "
                          f"{ctx.max_model_len:,}", data={"cache_block": block, "prompt_tokens_needed": goal})
        body, cold, sized = _cold_request(ctx, goal)
        if not cold.ok:
            return Result("prefix_cache", FAIL, f"cold request of {goal:,} tokens: {cold.why()}", data=sized.as_data())
        resized = (f"prefill's {n:,}-token prompt cannot show a hit in {block:,}-token cache blocks: a cold one of "
                   f"{sized.note}")
        n = int((cold.body.get("usage") or {}).get("prompt_tokens") or sized.tokens)
        ctx.prefill.update({"body": body, "seconds": cold.seconds, "tokens": n, "scaled": "", "sizing": resized,
                            "first_logprobs": _first_logprobs(cold.body), "text": _text(cold.body)})
        before, why = _scrape(ctx)
    reply = ctx.client.post("/v1/completions", ctx.prefill["body"])
    if not reply.ok:
        return Result("prefix_cache", FAIL, f"repeat request: {reply.why()}")
    ctx.prefill["repeat_first_logprobs"] = _first_logprobs(reply.body)
    ctx.prefill["repeat_text"] = _text(reply.body)
    ctx.prefill["repeat_seconds"] = reply.seconds
    n = ctx.prefill["tokens"]
    after, why_after = _scrape(ctx) if before is not None else (None, why)
    h0 = before.total("vllm:prefix_cache_hits") if before else None
    h1 = after.total("vllm:prefix_cache_hits") if after else None
    if h0 is not None and h1 is not None:
        gained = h1 - h0
        need = th.min_prefix_hit * n
        if block and resized and 0 < reachable_hit(n, block) < need:  # the sizer landed short of the goal
            need = reachable_hit(n, block)
        ok = gained >= need
        detail = (f"hits {h0:,.0f} -> {h1:,.0f} (+{gained:,.0f} of {n:,} prompt tokens) in vllm:prefix_cache_hits_total; "
                  f"repeat {reply.seconds:.2f} s vs cold {ctx.prefill['seconds']:.2f} s"
                  + (f"; prompt {ctx.prefill['scaled']}" if ctx.prefill.get("scaled") else "")
                  + (f"; {ctx.prefill['sizing']}" if ctx.prefill.get("sizing") else ""))
        if block:
            detail += f"; cache block {block:,} tokens (vllm:cache_config_info)"
        if not ok:
            detail = "NO prefix-cache hit: " + detail + f" (need {need:,.0f}; serve with PREFIX_CACHE=1?)"
        return Result("prefix_cache", PASS if ok else FAIL, detail,
                      data={"hits_before": h0, "hits_after": h1, "prompt_tokens": n, "method": "metrics",
                            **({"cache_block": block} if block else {}), **({"resized": True} if resized else {})})
    # No counters to read: a timing heuristic, labelled as such (a warm page cache alone can halve it).
    cold, warm = ctx.prefill["seconds"], reply.seconds
    ok = warm < 0.5 * cold
    return Result("prefix_cache", PASS if ok else FAIL,
                  f"timing fallback (no vllm:prefix_cache_hits_total: {why or why_after or 'family absent'}): repeat "
                  f"{warm:.2f} s vs cold {cold:.2f} s, " + ("consistent with a hit" if ok else "no sign of a hit")
                  + " (a warm page cache alone can also halve it)",
                  data={"method": "timing", "cold_s": cold, "repeat_s": warm})


def check_determinism(ctx: Context) -> Result:
    th = ctx.thresholds
    body = {"model": ctx.model, "prompt": P.DETERMINISM_PROMPT, "max_tokens": th.det_tokens,
            "temperature": 0, "logprobs": 3}
    texts, tops = [], []
    for _ in range(th.det_runs):
        reply = ctx.client.post("/v1/completions", body)
        if not reply.ok:
            return Result("determinism", FAIL, f"/v1/completions: {reply.why()}")
        texts.append(_text(reply.body))
        tops.append(_first_logprobs(reply.body))
    problems = []
    for i in range(1, len(texts)):
        if texts[i] != texts[0]:
            at = next((k for k, (a, b) in enumerate(zip(texts[0], texts[i])) if a != b), min(len(texts[0]), len(texts[i])))
            problems.append(f"run {i + 1} text differs from run 1 at char {at}: {texts[0][at:at + 24]!r} vs {texts[i][at:at + 24]!r}")
            break
    worst = max((_logprob_delta(tops[0], t) for t in tops[1:]), default=0.0)
    if worst > th.logprob_tol:
        problems.append(f"first-token top logprobs differ by {worst:.3g} (> TEST_LOGPROB_TOL={th.logprob_tol:g})")
    extra = ""
    if ctx.prefill.get("repeat_first_logprobs") is not None:
        d = _logprob_delta(ctx.prefill["first_logprobs"], ctx.prefill["repeat_first_logprobs"])
        same = ctx.prefill.get("text") == ctx.prefill.get("repeat_text")
        extra = f"; cold vs prefix-hit prefill: first-token logprobs delta {d:.3g}"
        if d > th.logprob_tol or not same:
            problems.append(f"the prefix-cache hit changed the first token's logprobs (delta {d:.3g})"
                            + ("" if same else " and its text"))
    if problems:
        return Result("determinism", FAIL, "NO: " + "; ".join(problems) + " (stock top-k kernel? DET_TOPK=1 or EXACT_TOPK=1)",
                      data={"texts": texts})
    return Result("determinism", PASS, f"{th.det_runs} greedy runs identical ({len(texts[0])} chars), first-token "
                  f"top-3 logprobs within {th.logprob_tol:g}{extra}")


def check_decode(ctx: Context) -> Result:
    th = ctx.thresholds
    # the prompt (~40 tokens with the chat template) stays; the answer's length gives way
    max_tokens = th.decode_tokens
    scaled = ""
    if ctx.max_model_len and th.decode_tokens + PROMPT_RESERVE > ctx.max_model_len * PROMPT_HEADROOM:
        max_tokens = max(16, int(ctx.max_model_len * PROMPT_HEADROOM) - PROMPT_RESERVE)
        scaled = f"; max_tokens scaled from {th.decode_tokens} to {max_tokens} to fit max_model_len {ctx.max_model_len:,}"
    s = ctx.client.stream("/v1/chat/completions", {
        "model": ctx.model, "messages": [{"role": "user", "content": P.DECODE_PROMPT}],
        "max_tokens": max_tokens, "temperature": 0})
    if s.status != 200 or s.error:
        return Result("decode", FAIL, f"streamed chat completion: HTTP {s.status} {s.error}".strip())
    n = s.completion_tokens
    if n < 8 or s.first is None:
        return Result("decode", FAIL, f"answer too short to time ({n} tokens, finish_reason {s.finish_reason!r})")
    span = s.end - s.first
    tps = (n - 1) / span if span > 0 else float("inf")
    e2e = n / (s.end - s.sent)
    ok = tps >= th.min_decode_tps
    return Result("decode", PASS if ok else FAIL,
                  f"{n} tok in {s.end - s.sent:.2f} s => {tps:.1f} tok/s decode, {e2e:.1f} tok/s end-to-end "
                  f"(TTFT {s.ttft:.2f} s, finish {s.finish_reason}){scaled}"
                  + ("" if ok else f", below TEST_MIN_DECODE_TPS={th.min_decode_tps:g}"),
                  data={"tokens": n, "tok_s": tps, "e2e_tok_s": e2e, "ttft_s": s.ttft})


def check_metrics(ctx: Context) -> Result:
    snap, why = _scrape(ctx)
    if snap is None:
        return Result("metrics", FAIL, f"/metrics: {why}")
    missing = [f for f in M.CORE_FAMILIES if not snap.has(f)]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    # counters that exist but never move are as useless as absent ones (a counter registered in
    # one process and incremented in another reads 0 forever)
    for fam in ("vllm:generation_tokens", "vllm:request_success"):
        if ctx.generated and snap.has(fam) and not snap.total(fam):
            problems.append(f"{fam}_total is 0 after this run's requests")
    ple = [f for f in M.PLE_FAMILIES if snap.has(f)]
    ple_note = ""
    if ctx.expect_ple == "yes" or (ctx.expect_ple == "auto" and ple):
        absent = [f for f in M.PLE_FAMILIES if f not in ple]
        if absent:
            problems.append(f"PLE counters missing: {', '.join(absent)}")
        elif ctx.generated and not snap.total("vllm:ple_mmap_lookup_ops"):
            problems.append("vllm:ple_mmap_lookup_ops_total is 0 after a prefill (counters not wired to the engine?)")
        else:
            ple_note = f"; PLE counters: {len(ple)}/8, {snap.total('vllm:ple_mmap_lookup_ops'):,.0f} lookups"
    elif ctx.expect_ple == "no" and ple:
        problems.append(f"PLE counters present although not expected: {', '.join(ple)}")
    else:
        ple_note = "; no vllm:ple_mmap_* (PLE mmap patch off or counters disabled)"
    if problems:
        hint = None
        if any(p.startswith("PLE counters missing") for p in problems):
            hint = ("the counters live in the engine process; flash_vllm's metrics bridge carries them to "
                    "/metrics (look for 'PLE metrics bridge' in the server log; FLASH_METRICS_BRIDGE=0 turns "
                    "it off); PROM_MULTIPROC=1 exports them too but drops *_created, process_* families "
                    "(docs/OBSERVABILITY.md)")
        return Result("metrics", FAIL, "; ".join(problems), data={"families": len(snap.families),
                                                                   **({"hint": hint} if hint else {})})
    return Result("metrics", PASS, f"{len(snap.families)} families, the {len(M.CORE_FAMILIES)} expected vllm:* present"
                  + ple_note, data={"families": len(snap.families)})


CHECKS: dict[str, Callable[[Context], Result]] = {
    "health": check_health, "model": check_model, "context": check_context, "coherence": check_coherence, "effort": check_effort,
    "tool_call": check_tool_call, "prefill": check_prefill, "prefix_cache": check_prefix_cache,
    "determinism": check_determinism, "decode": check_decode, "metrics": check_metrics,
}
assert tuple(CHECKS) == CHECK_NAMES


def run(ctx: Context, only: set[str] | None = None, skip: set[str] | None = None,
        on_result: Callable[[Result], Any] | None = None) -> list[Result]:
    """Run the checks in order. An unhealthy server skips everything after health; a check
    that raises is a failure with the exception's text (never a crash of the whole run)."""
    results = []
    for name, fn in CHECKS.items():
        start = time.perf_counter()
        if name not in ("health", "model") and (only and name not in only or skip and name in skip):
            res = Result(name, SKIP, "not selected (--only/--skip)", required=False)
        elif name in ctx.not_applicable:
            res = Result(name, NA, f"n/a: {ctx.not_applicable[name]}", required=False)
        elif name != "health" and not ctx.healthy:
            res = Result(name, SKIP, "server not healthy")
        elif name not in ("health", "model") and ctx.model is None:
            res = Result(name, SKIP, "no model id (the model check failed)")
        else:
            try:
                res = fn(ctx)
            except Exception as exc:  # a bug or a malformed reply must fail this check, not hide the rest
                res = Result(name, FAIL, f"{type(exc).__name__}: {exc}")
        res.seconds = time.perf_counter() - start
        if name not in ("health", "model", "context", "metrics") and res.status != SKIP:
            ctx.generated = True
        results.append(res)
        if on_result:
            on_result(res)
    return results


def summary(results: list[Result]) -> dict:
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP, NA)}
    failed = [r.name for r in results if r.status == FAIL and r.required]
    return {"passed": counts[PASS], "failed": counts[FAIL], "skipped": counts[SKIP],
            "not_applicable": {r.name: r.detail[len("n/a: "):] for r in results if r.status == NA},
            "failed_required": failed, "ok": not failed}
