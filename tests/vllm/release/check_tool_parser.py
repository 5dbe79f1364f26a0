"""Patch 13 with the release's real Qwen3 parser grammar and streaming engine."""

from __future__ import annotations

import pytest

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>")


def _engine():
    from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine
    from vllm.parser.qwen3 import qwen3_config

    return StreamingParserEngine(qwen3_config(thinking=False), None)


def _run(text: str, chunk: int | None = None):
    from vllm.parser.engine.events import EventType

    eng = _engine()
    events = []
    if chunk is None:
        events = eng.parse_complete(text)
    else:
        for i in range(0, len(text), chunk):
            events += eng.feed(text[i:i + chunk], [])
        events += eng.finish()
    content = "".join(e.value for e in events if e.type == EventType.TEXT_CHUNK)
    names = [e.value for e in events if e.type == EventType.TOOL_NAME]
    calls = sum(e.type == EventType.TOOL_CALL_START for e in events)
    return content, names, calls


FENCED = "Example:\n```xml\n" + CALL + "\n```\nThat is the format."
QUOTED = "Wrap each call in `<tool_call>` tags, and name it with '<function=NAME>'."
MIDLINE = "The bare form is <function=x> without a wrapper."


@pytest.mark.parametrize("chunk", [None, 1, 7])
@pytest.mark.parametrize("text", [FENCED, QUOTED, MIDLINE], ids=["fenced", "quoted", "midline"])
def test_quoted_or_fenced_markers_stay_text(registered, text, chunk):
    content, names, calls = _run(text, chunk)
    assert calls == 0 and not names
    assert content == text


@pytest.mark.parametrize("chunk", [None, 1, 5])
@pytest.mark.parametrize("prefix", ["", "Let me check.\n\n", "Checking now. ",
                                    "```\ncode\n```\n"], ids=["bare", "after-para", "mid-line", "after-fence"])
def test_real_calls_still_parse(registered, prefix, chunk):
    content, names, calls = _run(prefix + CALL, chunk)
    assert calls == 1 and "".join(names) == "get_weather"  # streamed names arrive in pieces
    assert content.strip() == prefix.strip()


def test_unpatched_engine_cuts_the_answer(registered):
    """The bug the guard fixes, shown with the stock methods on the same input."""
    from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine as E

    eng = _engine()
    for name in ("_on_terminal", "_emit_for_state", "reset"):
        setattr(eng, name, getattr(E, name).__flash_original__.__get__(eng))
    from vllm.parser.engine.events import EventType

    events = eng.parse_complete(FENCED)
    assert any(e.type == EventType.TOOL_CALL_START for e in events)
