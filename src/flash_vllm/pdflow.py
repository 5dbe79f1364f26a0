"""The prefill -> decode flow of a `pd` deployment, as vLLM's NixlConnector expects it, read from
vLLM 0.33's sources (nixl/pull_scheduler.py, nixl/base_scheduler.py, openai/*/protocol.py,
anthropic/protocol.py) and its tests' proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py):

1. prefill: the client's body with `kv_transfer_params` = PREFILL_KV_PARAMS, `stream` false,
   `max_tokens` 1 (and `max_completion_tokens` 1 when given), no `stream_options`, `min_tokens` /
   `min_completion_tokens` dropped (vLLM refuses min > max). The prefill server answers with
   `kv_transfer_params` (do_remote_prefill true, remote_engine_id, remote_request_id,
   remote_block_ids, remote_host, remote_port, tp_size, ...: its request_finished()).
2. decode: the client's own body plus those `kv_transfer_params`, relayed back as it comes.

Both legs carry the same `X-Request-Id` (the client's, or a new one) and the deployment's key.
A 4xx from a server is the client's (passed through); a 5xx, a refused connection or a timeout
is a 502 naming the stage. Several decode servers (pd3, pd4: one prefill box, N-1 decode boxes):
each request goes to the one with the fewest requests outstanding (ties in turn), chosen before
its prefill; a decode server that refuses the connection is marked down and the decode leg moves
to the next one (vLLM's NIXL pull works from any decode server: the prefill server holds the blocks
until one fetches them). The decode servers' health is watched (a poll, and every failed
connection): while all of them are down a request is a 503 at once, before any prefill is spent.
The legs run on aiohttp (a vLLM dependency), imported when the flow starts.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import uuid

# The Anthropic Messages API (Claude Code) takes the same handoff: vLLM 0.29-0.33's
# AnthropicMessagesRequest/Response carry kv_transfer_params.
PD_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/messages": "messages"}
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade",
               "proxy-authenticate", "proxy-authorization", "date", "server"}
FORWARDED_HEADERS = ("accept", "content-type")
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 3600.0  # a 500k-token prefill takes minutes on a Spark; a stall of an hour is a failure
HEALTH_TIMEOUT = 3.0
HEALTH_INTERVAL = 2.0
KEEPALIVE = 4.0
STREAM_ENDS = (b"[DONE]", b"message_stop")  # OpenAI's last SSE data line; Anthropic's last event


class StageError(Exception):
    """A server of one stage failed (5xx, refused, timed out, bad answer): the client gets a 502."""

    def __init__(self, stage: str, url: str, why: str):
        super().__init__(f"{stage} server {url} failed: {why}")
        self.stage, self.url, self.why = stage, url, why


class Backend:
    """One server. With router workers, its up/down verdict lives in a byte of shared memory (`shared`,
    slot `slot`): a server one worker saw go down (its watcher, a /health probe, a refused connection)
    is down for every worker at once, so none spends a prefill on it (the engine tier's pd test)."""

    def __init__(self, stage: str, url: str, name: str = "", shared=None, slot: int = 0):
        parsed = urllib.parse.urlsplit(url)
        try:
            port = parsed.port
        except ValueError:
            port = None
        if parsed.scheme != "http" or not parsed.hostname or not port or parsed.path not in ("", "/"):
            raise ValueError(f"--{stage} {url!r} is not http://HOST:PORT")
        self.stage, self.url = stage, url.rstrip("/")
        self.name = name or stage  # prefill, decode; decode1..decodeN when there are several
        self._shared, self._slot = shared, slot
        self._up: bool | None = None  # None: not checked yet
        self.why = "not checked yet"
        self.outstanding = 0  # decode: requests assigned to it, from their prefill to their last byte

    @property
    def up(self) -> bool | None:
        if self._shared is None:
            return self._up
        v = self._shared[self._slot]  # 0 not checked yet, 1 up, 2 down
        return None if v == 0 else v == 1

    def mark(self, up: bool, why: str) -> None:
        self._up, self.why = up, why
        if self._shared is not None:
            self._shared[self._slot] = 1 if up else 2

    def reason(self) -> str:
        """Why it is down: this worker's own verdict, or that another worker saw it go down."""
        return self.why if self._up is False or self._shared is None else "down as another router worker saw it"


def prefill_body(body: dict) -> dict:
    """The prefill stage's request: the client's body, asked for one token and the KV handoff."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)
    return out


def _why(exc: BaseException) -> str:
    import aiohttp

    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    return f"{type(exc).__name__}: {exc}"


def decode_backends(decode: str | list[str] | tuple[str, ...], shared=None) -> list[Backend]:
    """The decode servers: `decode` for one, `decode1`..`decodeN` (the pd deployment's box numbers)
    for several. The same URL twice is refused (it would be counted as two servers)."""
    urls = [decode] if isinstance(decode, str) else list(decode)
    if not urls:
        raise ValueError("--decode is required (one per decode server)")
    seen = set()
    for u in urls:
        if u.rstrip("/") in seen:
            raise ValueError(f"--decode {u!r} is given twice")
        seen.add(u.rstrip("/"))
    return [Backend("decode", u, "decode" if len(urls) == 1 else f"decode{i + 1}", shared, i + 1)
            for i, u in enumerate(urls)]


class Flow:
    """Every server behind one aiohttp session (its pool keeps connections to each alive)."""

    def __init__(self, prefill: str, decode: str | list[str], api_key: str | None, metrics=None, shared=None):
        # shared: one byte per server (prefill, then each decode), made before the workers fork
        self.prefill = Backend("prefill", prefill, shared=shared, slot=0)
        self.decodes = decode_backends(decode, shared)
        self.backends = (self.prefill, *self.decodes)
        self._turn = 0
        self.api_key = api_key or None
        self.metrics = metrics
        self.session = self.probes = None
        self._monitor: asyncio.Task | None = None

    async def start(self, health_interval: float = HEALTH_INTERVAL) -> None:
        import aiohttp

        # idle pooled connections are dropped before vLLM's uvicorn drops them (timeout_keep_alive 5 s),
        # so a request is never written into a connection the server is closing
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE),
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT),
            auto_decompress=False, skip_auto_headers=("User-Agent",))
        # health checks on a connection of their own each time: a verdict is about the server, never
        # about a pooled connection it has closed
        self.probes = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                            skip_auto_headers=("User-Agent",))
        await asyncio.gather(*(self.check(b) for b in self.backends))
        self._monitor = asyncio.create_task(self._watch(health_interval))

    async def close(self) -> None:
        if self._monitor:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        for s in (self.session, self.probes):
            if s:
                await s.close()

    async def _watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self.check(b) for b in self.backends))

    def auth_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _set_up(self, b: Backend, up: bool, why: str) -> None:
        b.mark(up, why)
        if self.metrics:
            self.metrics.up.labels(b.stage, b.name).set(1 if up else 0)

    def pick(self, skip: tuple[Backend, ...] = ()) -> Backend | None:
        """The decode server for the next request: of those not known to be down, the one with the
        fewest requests outstanding; ties go in turn. None: every decode server is down."""
        live = [b for b in self.decodes if b.up is not False and b not in skip]
        if not live:
            return None
        n = len(self.decodes)
        start, self._turn = self._turn, (self._turn + 1) % n
        return min(live, key=lambda b: (b.outstanding, (self.decodes.index(b) - start) % n))

    def _take(self, b: Backend, delta: int) -> None:
        b.outstanding += delta
        if self.metrics:
            self.metrics.outstanding.labels(b.name).set(b.outstanding)

    def down_error(self) -> StageError:
        """The 503 when no decode server is up: each one's state named."""
        if len(self.decodes) == 1:
            d = self.decodes[0]
            return StageError("decode", d.url, f"down ({d.reason()})")
        return StageError("decode", ", ".join(d.url for d in self.decodes),
                          "all down (" + "; ".join(f"{d.name}: {d.reason()}" for d in self.decodes) + ")")

    async def get(self, b: Backend, path: str, timeout: float = HEALTH_TIMEOUT) -> tuple[int, bytes]:
        import aiohttp

        try:
            async with self.probes.get(b.url + path, headers=self.auth_headers(),
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise StageError(b.stage, b.url, _why(exc)) from None

    async def check(self, b: Backend) -> str:
        """GET /health of one server: "ok", or why not; the verdict is kept for the request path."""
        try:
            status, _ = await self.get(b, "/health")
            state = "ok" if status == 200 else f"HTTP {status}"
        except StageError as exc:
            state = exc.why
        self._set_up(b, state == "ok", state)
        return state

    def headers(self, client: dict, request_id: str | None) -> dict:
        h = {"Content-Type": "application/json", **self.auth_headers()}
        if request_id:
            h["X-Request-Id"] = request_id
        if client.get("accept"):
            h["Accept"] = client["accept"]
        return h

    # -- the P/D request ---------------------------------------------------------------------------
    async def disaggregated(self, path: str, body: dict, client: dict, send) -> str:
        """Prefill, then decode relayed to the client through `send` (ASGI); the outcome's name."""
        endpoint = PD_PATHS[path]
        anthropic = endpoint == "messages"
        d = self.pick()
        if d is None:  # no prefill for a request that cannot be decoded
            await self._error(send, 503, self.down_error(), anthropic, "ServiceUnavailable")
            return "decode_down"
        held = [d]  # the decode server this request counts against (it moves on a refused connection)
        self._take(d, +1)
        try:
            return await self._disaggregated(path, body, client, send, anthropic, held)
        finally:
            self._take(held[0], -1)

    async def _disaggregated(self, path: str, body: dict, client: dict, send, anthropic: bool,
                             held: list[Backend]) -> str:
        m = self.metrics
        d = held[0]
        rid = client.get("x-request-id") or str(uuid.uuid4())
        hdrs = self.headers(client, rid)

        # 1. prefill: one token, and the KV handoff parameters back
        p = self.prefill
        t = time.monotonic()
        try:
            async with self.session.post(p.url + path, data=json.dumps(prefill_body(body)).encode(),
                                         headers=hdrs) as resp:
                status, ctype, answer = resp.status, resp.headers.get("Content-Type"), await resp.read()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every transport failure is the prefill server's
            err = StageError("prefill", p.url, _why(exc))
            if m:
                m.stage_requests.labels("prefill", "unreachable").inc()
            await self._error(send, 502, err, anthropic)
            return "prefill_error"
        if m:
            m.stage_seconds.labels("prefill").observe(time.monotonic() - t)
            m.stage_requests.labels("prefill", str(status)).inc()
        if 400 <= status < 500:  # the client's mistake, said by the server that saw it
            await _send_whole(send, status, answer, ctype)
            return "client_error"
        if status != 200:
            await self._error(send, 502, StageError("prefill", p.url, f"HTTP {status}: "
                                                    f"{answer[:300].decode('utf-8', 'replace')}"), anthropic)
            return "prefill_error"
        try:
            kv = json.loads(answer).get("kv_transfer_params")
        except (ValueError, AttributeError, RecursionError):
            await self._error(send, 502, StageError("prefill", p.url, "its answer is not a JSON object"), anthropic)
            return "prefill_error"
        if kv:
            body = {**body, "kv_transfer_params": kv}
        elif m:
            m.kv_missing.inc()

        # 2. decode: the client's request with the handoff, relayed as it comes; a decode server that
        # refuses the connection hands the request to the next one that is up (nothing was sent yet)
        t = time.monotonic()
        data = json.dumps(body).encode()
        tried: tuple[Backend, ...] = ()
        while True:
            last = len(tried) + 1 >= len(self.decodes)
            outcome = await self.relay(d, "POST", path, data, hdrs, send, anthropic, retry_refused=not last)
            if outcome != "refused":
                break
            tried += (d,)
            nxt = self.pick(skip=tried)
            if nxt is None:
                await self._error(send, 502, StageError("decode", d.url, f"{d.why}; no other decode server is up"),
                                  anthropic)
                return "decode_error"
            self._take(d, -1)
            self._take(nxt, +1)
            d = held[0] = nxt
        if m and outcome != "decode_error":
            m.stage_seconds.labels("decode").observe(time.monotonic() - t)
        return outcome

    async def relay(self, b: Backend, method: str, path: str, data: bytes | None, hdrs: dict, send,
                    anthropic: bool = False, retry_refused: bool = False) -> str:
        """One server's answer to the client as it comes. A server that breaks off after the
        headers cannot turn into a 502 any more: an SSE stream gets an in-stream error event
        (vLLM's shape), anything else is cut. Cancelled (the client left): the upstream
        connection is closed, so vLLM aborts the request. `retry_refused`: a refused connection
        sends nothing and returns "refused" (the caller tries another decode server)."""
        m = self.metrics
        try:
            resp = await self.session.request(method, b.url + path, data=data, headers=hdrs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            err = StageError(b.stage, b.url, _why(exc))
            if m:
                m.stage_requests.labels(b.stage, "unreachable").inc()
            if "cannot connect" in err.why:
                self._set_up(b, False, err.why)  # the next requests go elsewhere, or are refused before their prefill
                if retry_refused:
                    return "refused"
            await self._error(send, 502, err, anthropic)
            return f"{b.stage}_error"
        try:
            if m:
                m.stage_requests.labels(b.stage, str(resp.status)).inc()
            if resp.status >= 500:
                try:
                    answer = await resp.read()
                except Exception:  # noqa: BLE001
                    answer = b""
                await self._error(send, 502, StageError(b.stage, b.url, f"HTTP {resp.status}: "
                                                        f"{answer[:300].decode('utf-8', 'replace')}"), anthropic)
                return f"{b.stage}_error"
            headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()
                       if k.lower() not in HOP_HEADERS]
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            sse = "text/event-stream" in resp.headers.get("Content-Type", "")
            tail = b""
            broke = ""
            try:
                async for chunk in resp.content.iter_any():
                    tail = (tail + chunk)[-64:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                broke = f"broke off ({type(exc).__name__})"
            if sse and not broke and not any(end in tail for end in STREAM_ENDS):
                broke = "ended without its last event"  # vLLM ends every stream with one
            if broke and sse:
                err = StageError(b.stage, b.url, broke)
                event = (b"event: error\ndata: " + _err(502, err, True, "api_error") if anthropic
                         else b"data: " + _err(502, err, False))
                await send({"type": "http.response.body", "body": event + b"\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if broke:
                return f"{b.stage}_error"
            return "client_error" if resp.status >= 400 else "ok"
        finally:
            resp.close()  # after a full read: back to the pool; cut short: the connection is closed

    async def _error(self, send, code: int, err: StageError, anthropic: bool, kind: str = "BadGateway") -> None:
        await _send_whole(send, code, _err(code, err, anthropic, "api_error" if anthropic else kind),
                          "application/json")


def _err(code: int, err: StageError, anthropic: bool, kind: str = "BadGateway") -> bytes:
    from .httpedge import error_body

    return error_body(code, str(err), kind, err.stage, anthropic)


async def _send_whole(send, code: int, body: bytes, ctype: str | None) -> None:
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", (ctype or "application/json").encode("latin-1")),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
