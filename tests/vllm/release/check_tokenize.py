"""`flash test` sizes its prefill prompt with the server's `POST /tokenize` (gates/sizing.py): the
request it sends and the reply fields it reads, against each release's own protocol models, and the
stand-in's reply (tests/standin/server.py r_tokenize) validated by the release's TokenizeResponse."""

from __future__ import annotations


def test_tokenize_request_and_response_shapes():
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeCompletionRequest, TokenizeResponse

    # what sizing.count_tokens sends: {"model", "prompt"}; special tokens added by default, like
    # /v1/completions, so the count is what the completion is charged
    req = TokenizeCompletionRequest.model_validate({"model": "qwen3.8-flash-next", "prompt": "Session x. ledger"})
    assert req.prompt == "Session x. ledger" and req.add_special_tokens is True
    # what it reads: count, max_model_len (tokens alongside)
    fields = set(TokenizeResponse.model_fields)
    assert {"count", "max_model_len", "tokens"} <= fields, fields
    # the stand-in's reply is a valid TokenizeResponse of this release
    standin = {"count": 3, "max_model_len": 2048, "tokens": [11, 12, 13], "token_strs": None}
    assert TokenizeResponse.model_validate(standin).model_dump() == standin
    # the route is POST /tokenize (not under /v1); read from the source: importing the router needs
    # orjson/fastapi extras the CPU venv lacks
    import importlib.util
    from pathlib import Path

    src = Path(importlib.util.find_spec("vllm.entrypoints.serve.tokenize.api_router").origin).read_text()
    assert '@router.post(\n    "/tokenize",' in src, src[:2000]
    assert "async def tokenize(request: TokenizeRequest" in src
