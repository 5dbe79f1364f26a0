"""Patch 13: Qwen3 tool-call markers quoted in prose or inside a fenced code block stay text.

vLLM's parser engine (`vllm/parser/engine/streaming_parser_engine.py`, used by the qwen3_coder /
qwen3_xml tool parsers and the qwen3 reasoning parser) switches to a tool call on every
`<tool_call>` or `<function=` terminal it sees in content or reasoning. A model explaining the
format ("wrap it in `<tool_call>`", or a fenced example) is then parsed as a call: the answer is
cut and a malformed tool call is returned. The guard tracks, per engine and per channel, the
plain text it has emitted: whether a CommonMark fence (``` or ~~~, up to 3 spaces of indent) is
open, and the current line so far. A marker that would open a tool call stays text when
- a fence is open (any marker), or
- it is quoted: the line so far ends with a backtick or a quote character (any marker), or
- it is `<function=` in the middle of a line (the bare-function fallback only ever starts a line).
Real calls (`<tool_call>` after text or at the start of a line, `<function=` at a line start)
still parse. An unclosed fence keeps suppressing later markers until it closes (as Markdown
would render it). Written against the releases' engine (no `validate_tool_preamble` there).
"""

from __future__ import annotations

import re

from flash_common import releases

from ...registry import Context, Gate, Patch, expect_installed, expect_source, install

NUMBER = 13
MODULE = "vllm.parser.engine.streaming_parser_engine"
ON_TERMINAL = (MODULE, "StreamingParserEngine._on_terminal")
EMIT = (MODULE, "StreamingParserEngine._emit_for_state")
RESET = (MODULE, "StreamingParserEngine.reset")
QUOTES = ("`", '"', "'", "\u201c", "\u2018")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


class _Track:
    __slots__ = ("fence", "line")

    def __init__(self):
        self.fence = ""   # the open fence's marker run ("```", "~~~~"), "" when none
        self.line = ""    # text of the current line so far

    def feed(self, text: str) -> None:
        parts = text.split("\n")
        for i, part in enumerate(parts):
            self.line += part
            if i < len(parts) - 1:  # a line ended
                self._close_line()

    def _close_line(self) -> None:
        m = FENCE.match(self.line)
        if m:
            run = m.group(1)
            if not self.fence:
                if not (run[0] == "`" and "`" in self.line[m.end():]):
                    self.fence = run
            elif run[0] == self.fence[0] and len(run) >= len(self.fence) and not self.line[m.end():].strip():
                self.fence = ""
        self.line = ""

    def in_fence(self) -> bool:
        if self.fence:
            return True
        m = FENCE.match(self.line)  # an opening fence line still being written
        return bool(m) and not (m.group(1)[0] == "`" and "`" in self.line[m.end():])


def _tracks(engine) -> dict:
    t = engine.__dict__.get("_flash_tracks")
    if t is None:
        t = engine.__dict__["_flash_tracks"] = {}
    return t


def _plain(engine) -> bool:
    plain = getattr(engine, "_PLAIN_STATES", None)  # 0.30+; 0.29 has no such constant
    if plain is None:
        import vllm.parser.engine.streaming_parser_engine as m

        plain = (m.ParserState.CONTENT, m.ParserState.REASONING)
    return engine.state in plain


def _is_marker(engine, transition) -> bool:
    return transition is not None and transition.next_state in engine._TOOL_STATES


def keep_as_text(track: _Track, value: str) -> bool:
    if track.in_fence():
        return True
    before = track.line.rstrip(" ")
    if before.endswith(QUOTES):
        return True
    return value.startswith("<function=") and before.strip() != ""


def _emit(orig):
    def _emit_for_state(self, text, token_count=0):
        if text and _plain(self):
            track = _tracks(self).setdefault(self.state, _Track())
            track.feed(text)
        return orig(self, text, token_count)

    _emit_for_state.__doc__ = orig.__doc__
    return _emit_for_state


def _terminal(orig):
    def _on_terminal(self, terminal, value, token_count=0):
        if _plain(self) and not getattr(self, "skip_tool_parsing", False):
            transition = self.config.transitions.get((self.state, terminal))
            if _is_marker(self, transition):
                track = _tracks(self).setdefault(self.state, _Track())
                if keep_as_text(track, value):
                    return self._emit_for_state(value, token_count)
        return orig(self, terminal, value, token_count)

    _on_terminal.__doc__ = orig.__doc__
    return _on_terminal


def _reset(orig):
    def reset(self, *args, **kwargs):
        self.__dict__.pop("_flash_tracks", None)
        return orig(self, *args, **kwargs)

    reset.__doc__ = orig.__doc__
    return reset


def check(ctx: Context) -> None:
    expect_source(*ON_TERMINAL, "transition = self.config.transitions.get(key)", "self._emit_for_state(")
    expect_source(*EMIT, "content_type = self.config.content_events.get(self.state)")
    expect_source(MODULE, "StreamingParserEngine", "_TOOL_STATES", "ParserState.CONTENT")


def apply(ctx: Context) -> None:
    install(NUMBER, *EMIT, _emit)
    install(NUMBER, *ON_TERMINAL, _terminal)
    install(NUMBER, *RESET, _reset)


def verify(ctx: Context) -> None:
    for target in (EMIT, ON_TERMINAL, RESET):
        expect_installed(NUMBER, *target)


PATCH = Patch(
    number=NUMBER,
    name="tool-marker-guard",
    title="Qwen3 tool parser: quoted or fenced tool-call markers stay text",
    why=("The releases' parser engine opens a tool call on any `<tool_call>`/`<function=` in "
         "content, so a model explaining the format (quoted, or in a fenced code block) gets its "
         "answer cut into a malformed call. Markers inside an open fence, right after a quote, "
         "or `<function=` mid-line stay text; real calls still parse."),
    upstream="none in 0.29.0-0.33.0 (no fence awareness or validate_tool_preamble in the engine)",
    gate=Gate.always("always on (FLASH_DISABLE_PATCHES=13 turns it off)"),
    targets=tuple(f"{m}:{q}" for m, q in (ON_TERMINAL, EMIT, RESET)),
    applies_to=releases.since("0.29.0"),
    check=check, apply=apply, verify=verify,
)
