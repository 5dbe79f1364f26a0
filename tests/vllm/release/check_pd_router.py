"""pd's router (flash_vllm.pdrouter) against each release's own P/D shapes (issue 15): the prefill
leg the router builds is accepted by the release's request classes and keeps the NIXL handoff;
the answer classes carry `kv_transfer_params`; the NixlConnector's prefill-side answer
(`nixl/pull_scheduler.py::request_finished`) has the fields the decode side needs and that the
unit tier's fake servers (tests/fakes/pd.py, written from 0.33) answer."""

from __future__ import annotations

import ast
import inspect

import pytest

from fakes.pd import DECODE_NEEDS, FakeServer
from flash_vllm import pdrouter

CLIENT = {
    "completions": {"model": "m", "prompt": "hi", "max_tokens": 50, "min_tokens": 3, "stream": True,
                    "stream_options": {"include_usage": True}},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50,
             "min_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
    "messages": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4096, "stream": True,
                 "thinking": {"type": "enabled", "budget_tokens": 2048}},
}


def request_class(endpoint: str):
    if endpoint == "completions":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as C
    elif endpoint == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as C
    else:
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest as C
    return C


@pytest.mark.parametrize("endpoint", sorted(CLIENT))
def test_the_prefill_leg_is_a_valid_request_that_keeps_the_handoff(endpoint):
    assert f"/v1/{'chat/completions' if endpoint == 'chat' else endpoint}" in pdrouter.PD_PATHS
    req = request_class(endpoint)(**pdrouter.prefill_body(CLIENT[endpoint]))
    assert req.kv_transfer_params == pdrouter.PREFILL_KV_PARAMS
    assert req.max_tokens == 1 and not req.stream
    if endpoint == "chat":
        assert req.max_completion_tokens == 1
    # and the decode leg (the client's own body plus the prefill's answer) is valid too
    answer = FakeServer.kv_answer(_Fake(), "cmpl-1-0", 5)
    dec = request_class(endpoint)(**{**CLIENT[endpoint], "kv_transfer_params": answer})
    assert dec.kv_transfer_params["do_remote_prefill"] is True and dec.stream


class _Fake:  # kv_answer() needs only these two attributes
    engine_id = "e"
    issued: dict = {}


def test_the_answer_classes_carry_kv_transfer_params():
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesResponse
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    for cls in (CompletionResponse, ChatCompletionResponse, AnthropicMessagesResponse):
        assert "kv_transfer_params" in cls.model_fields, cls


def test_the_prefill_side_answers_what_the_decode_side_and_our_fakes_use():
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_scheduler

    tree = ast.parse(inspect.getsource(pull_scheduler))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "request_finished")
    calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "dict"]
    assert len(calls) == 1
    keys = {k.arg for k in calls[0].keywords}
    assert {"do_remote_prefill", "do_remote_decode", *DECODE_NEEDS} <= keys
    fake = set(FakeServer.kv_answer(_Fake(), "r", 1))
    assert keys <= fake, keys - fake  # the fakes answer at least what this release answers
    if vllm.__version__ == "0.33.0":  # ... and exactly what the release they were written from answers
        assert keys == fake
