"""HTTP to the server under test: JSON posts with timings, and SSE streams with per-token times.

One `requests.Session` per run (keep-alive: a TTFT should not include a TCP handshake).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    status: int  # 0: no connection (refused, reset, timed out)
    body: Any = None  # parsed JSON, or None
    text: str = ""
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and isinstance(self.body, dict)

    def why(self) -> str:
        """One line for a failed request: the server's own message when it sent one."""
        if self.status == 0:
            return f"no connection ({self.error})"
        msg = ""
        if isinstance(self.body, dict):
            err = self.body.get("error", self.body.get("detail", ""))
            msg = err.get("message", "") if isinstance(err, dict) else str(err)
        return f"HTTP {self.status}" + (f": {msg[:200]}" if msg else (f": {self.text[:200]}" if self.text else ""))


@dataclass
class Stream:
    """A streamed completion: when the request went out, when each piece came back."""

    status: int
    sent: float = 0.0
    first: float | None = None  # first generated text (content or reasoning)
    end: float = 0.0
    pieces: list[str] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    finish_reason: str | None = None
    error: str = ""

    @property
    def completion_tokens(self) -> int:
        n = self.usage.get("completion_tokens")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else len(self.pieces)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


class StreamError(ValueError):
    """A server-sent event that is not an OpenAI completion chunk (names the offending line)."""


def _bad(line: str, why: str) -> StreamError:
    return StreamError(f"bad SSE line {line[:120]!r}{'…' if len(line) > 120 else ''}: {why}")


def feed_sse_line(line: str, out: Stream, now: float | None = None) -> bool:
    """Apply one line of an OpenAI-style SSE stream to `out`; True at `data: [DONE]`.

    Lines other than `data:` ones (comments, `event:`, blank keep-alives) are ignored. A `data:`
    payload must be a JSON object whose `choices` is a list of objects with string `text` /
    `delta.content` / `delta.reasoning_content` pieces; anything else raises StreamError.
    """
    if not line or not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _bad(line, f"not JSON ({exc})") from None
    if not isinstance(chunk, dict):
        raise _bad(line, f"a JSON {type(chunk).__name__}, expected an object")
    usage = chunk.get("usage")
    if usage:
        if not isinstance(usage, dict):
            raise _bad(line, "usage is not an object")
        out.usage = usage
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise _bad(line, "choices is not a list")
    for choice in choices:
        if not isinstance(choice, dict):
            raise _bad(line, "a choice is not an object")
        piece = choice.get("text")
        if piece is None:
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise _bad(line, "delta is not an object")
            parts = (delta.get("content"), delta.get("reasoning_content") or delta.get("reasoning"))
            if any(p is not None and not isinstance(p, str) for p in parts):
                raise _bad(line, "delta content is not text")
            piece = "".join(p for p in parts if p)
        elif not isinstance(piece, str):
            raise _bad(line, "text is not a string")
        if piece:
            if out.first is None:
                out.first = time.perf_counter() if now is None else now
            out.pieces.append(piece)
        reason = choice.get("finish_reason")
        if reason:
            out.finish_reason = str(reason)
    return False


def describe(exc: Exception, timeout: float) -> str:
    """One short phrase for a transport error (requests' own text nests three exceptions)."""
    import requests

    if isinstance(exc, requests.Timeout):
        return f"timed out after {timeout:g} s"
    if isinstance(exc, requests.ConnectionError):
        text = str(exc)
        if "refused" in text:
            return "connection refused"
        if "Name or service not known" in text or "resolve" in text:
            return "host name does not resolve"
        return "connection failed"
    return f"{type(exc).__name__}: {str(exc)[:160]}"


class Client:
    def __init__(self, url: str, key: str | None = None, timeout: float = 600.0):
        import requests

        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        if key:
            self.session.headers["Authorization"] = f"Bearer {key}"

    def get(self, path: str, timeout: float | None = None) -> Reply:
        return self._call("GET", path, None, timeout)

    def post(self, path: str, body: dict, timeout: float | None = None) -> Reply:
        return self._call("POST", path, body, timeout)

    def _call(self, method: str, path: str, body: dict | None, timeout: float | None) -> Reply:
        import requests

        start = time.perf_counter()
        try:
            resp = self.session.request(method, self.url + path, json=body, timeout=timeout or self.timeout)
        except requests.RequestException as exc:
            return Reply(0, seconds=time.perf_counter() - start, error=describe(exc, timeout or self.timeout))
        seconds = time.perf_counter() - start
        parsed = None
        if "json" in resp.headers.get("content-type", ""):
            try:
                parsed = resp.json()
            except ValueError:
                parsed = None
        return Reply(resp.status_code, parsed, resp.text, seconds)

    def stream(self, path: str, body: dict, timeout: float | None = None) -> Stream:
        """POST with stream=true; records the arrival time of the first generated text."""
        import requests

        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        out = Stream(0, sent=time.perf_counter())
        try:
            with self.session.post(self.url + path, json=body, stream=True, timeout=timeout or self.timeout) as resp:
                out.status = resp.status_code
                if resp.status_code != 200:
                    out.error = resp.text[:300]
                    out.end = time.perf_counter()
                    return out
                for line in resp.iter_lines(decode_unicode=True):
                    if feed_sse_line(line, out):
                        break
        except (requests.RequestException, ValueError) as exc:
            out.error = describe(exc, timeout or self.timeout)
        out.end = time.perf_counter()
        return out
