"""The pd router's network edge: what every connection and request passes before the P/D flow
sees it. An ASGI middleware (`Guard`) and a uvicorn protocol (`edge_protocol`) for uvicorn +
httptools, the stack vLLM serves with; both imported lazily (the router runs inside the vLLM
image, where the plugin must not pull them in).

- The API key: deny by default. With a key, every request needs `Authorization: Bearer KEY` but
  GET/HEAD of exactly `/health` and `/metrics` without a query. The check reads the *decoded*
  path uvicorn hands the app (`/%76%31/...` is `/v1/...`; an absolute-form target is reduced to its
  path), and runs on the headers alone, before any body byte is read. Compared like vLLM does
  (serve/middleware/authenticate.py): sha256 of both, then a constant-time compare.
- Framing: httptools refuses a malformed Content-Length or chunked body with 400 before the app
  runs; a body-carrying method without Content-Length or chunking is a 411.
- Size: a declared Content-Length over the cap is a 413 before reading; a chunked body is counted
  as it comes and cut at the cap with a 413.
- Time: a connection must finish its request headers within `header_timeout` (uvicorn has no such
  timer: a half-sent request would be held forever); a body that stalls `body_timeout` is a 408;
  idle keep-alive connections close after uvicorn's `timeout_keep_alive`.
- Count: connections past `max_connections` are closed at accept; uvicorn's `limit_concurrency`
  answers 503 past the same number of requests in flight in one process. With several workers
  (pdrouter --workers) the connection cap is the router's, not each worker's: every worker counts
  its open connections in its own slot of a shared array (`Tally`) and admits one only while the
  sum is under the cap (two workers admitting at the same instant can pass it by at most
  workers-1). `limit_concurrency` stays per worker, but a request in flight holds a counted
  connection (HTTP/1.1, one at a time each), so the shared cap bounds the router's requests too.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from dataclasses import dataclass

OPEN_PATHS = frozenset({"/health", "/metrics"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True)
class Limits:
    api_key: str | None = None
    max_body: int = 64 * 2**20  # a 1M-token prompt is ~4 MB of JSON; images in base64 need more room
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 5.0  # uvicorn's default, which vLLM serves with
    max_connections: int = 4096
    backlog: int = 2048  # uvicorn's default, as vLLM's API server


def error_body(code: int, message: str, err_type: str, stage: str | None = None, anthropic: bool = False) -> bytes:
    """vLLM's error shapes: OpenAI's ErrorResponse ({"error": {message, type, param, code}}), or the
    Anthropic API's ({"type": "error", "error": {type, message}}) on /v1/messages; plus the stage."""
    if anthropic:
        err = {"type": err_type, "message": message}
        if stage:
            err["stage"] = stage
        return json.dumps({"type": "error", "error": err}).encode()
    err = {"message": message, "type": err_type, "param": None, "code": code}
    if stage:
        err["stage"] = stage
    return json.dumps({"error": err}).encode()


async def send_bytes(send, code: int, body: bytes, ctype: bytes = b"application/json",
                     close: bool = False) -> None:
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    if close:  # uvicorn closes the connection after a response that says so
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def key_matches(given: bytes, key: str) -> bool:
    scheme, _, token = given.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(hashlib.sha256(token).digest(), hashlib.sha256(key.encode()).digest())


class _BodyTooLarge(Exception):
    pass


class _BodyStalled(Exception):
    pass


class Guard:
    """ASGI middleware: key, framing, size and body-time checks before the app reads anything."""

    def __init__(self, app, limits: Limits, on_refused=None):
        self.app, self.limits = app, limits
        self.on_refused = on_refused or (lambda path, why: None)  # (path, "unauthorized" | "too_large" | ...)
        self._key_hash = None

    def authorized(self, scope) -> bool:
        key = self.limits.api_key
        if not key:
            return True
        if scope["method"] in ("GET", "HEAD") and scope["path"] in OPEN_PATHS and not scope.get("query_string"):
            return True
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        return key_matches(given, key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if not self.authorized(scope):
            self.on_refused(path, "unauthorized")
            # the body is never read: close instead of leaving its bytes in the stream
            return await send_bytes(send, 401, json.dumps({"error": "Unauthorized"}).encode(), close=True)
        headers = dict(scope["headers"])  # httptools lower-cases names; a repeated name: the last one
        length = headers.get(b"content-length")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        if scope["method"] in BODY_METHODS and length is None and not chunked:
            self.on_refused(path, "length_required")
            return await send_bytes(send, 411, error_body(411, "a request body needs Content-Length or chunked "
                                                          "Transfer-Encoding", "LengthRequired"), close=True)
        # httptools has refused a Content-Length that is not all digits (400) before this point
        if length is not None and int(length) > self.limits.max_body:
            self.on_refused(path, "too_large")
            return await send_bytes(send, 413, error_body(413, f"the request body is {int(length)} bytes; the "
                                                          f"router accepts at most {self.limits.max_body}",
                                                          "RequestTooLarge"), close=True)
        started = False
        received = 0
        body_done = scope["method"] not in BODY_METHODS and not chunked and not length

        async def guarded_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()  # the body is in: what is left is the client leaving
            try:
                msg = await asyncio.wait_for(receive(), self.limits.body_timeout)
            except asyncio.TimeoutError:
                raise _BodyStalled from None
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.limits.max_body:
                    raise _BodyTooLarge
                body_done = not msg.get("more_body", False)
            return msg

        async def tracked_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, guarded_receive, tracked_send)
        except _BodyTooLarge:
            self.on_refused(path, "too_large")
            if not started:
                await send_bytes(send, 413, error_body(413, f"the request body is over {self.limits.max_body} bytes",
                                                       "RequestTooLarge"), close=True)
        except _BodyStalled:
            self.on_refused(path, "body_timeout")
            if not started:
                await send_bytes(send, 408, error_body(408, f"no request body byte in {self.limits.body_timeout:g} s",
                                                       "RequestTimeout"), close=True)


class Tally:
    """The open connections of every worker, one slot each in shared memory (a multiprocessing
    RawArray made before the workers fork). A slot has one writer, so no lock is needed, and a
    crashed worker's count is reset by its replacement instead of leaking."""

    def __init__(self, slots, index: int):
        self.slots, self.index = slots, index
        slots[index] = 0

    def admit(self, cap: int) -> bool:
        if sum(self.slots) >= cap:
            return False
        self.slots[self.index] += 1
        return True

    def release(self) -> None:
        self.slots[self.index] -= 1


def edge_protocol(limits: Limits, tally: Tally | None = None):
    """uvicorn's httptools protocol plus a header deadline and a connection cap (see the module's
    docstring). A class built on demand so that uvicorn is imported only when the router runs."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class EdgeProtocol(HttpToolsProtocol):
        _deadline = None
        _counted = False

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(limits.header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport is not None and not self.transport.is_closing():
                self.transport.abort()  # headers never completed: nothing to answer

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if tally is not None:
                self._counted = tally.admit(limits.max_connections)
                over = not self._counted
            else:
                over = len(self.connections) > limits.max_connections
            if over:
                transport.abort()
                return
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # a keep-alive connection's next request has the same deadline

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._counted:
                self._counted = False
                tally.release()
            super().connection_lost(exc)

    return EdgeProtocol
