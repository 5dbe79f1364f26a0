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
        return int(self.usage.get("completion_tokens") or len(self.pieces))

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


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
                    if not line or not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        out.usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        piece = choice.get("text")
                        if piece is None:
                            delta = choice.get("delta") or {}
                            piece = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
                        if piece:
                            if out.first is None:
                                out.first = time.perf_counter()
                            out.pieces.append(piece)
                        if choice.get("finish_reason"):
                            out.finish_reason = choice["finish_reason"]
        except (requests.RequestException, ValueError) as exc:
            out.error = describe(exc, timeout or self.timeout)
        out.end = time.perf_counter()
        return out
