"""The prefill/decode router of a `pd` deployment: one OpenAI-compatible endpoint in front of a
vLLM prefill server (NixlConnector kv_producer) and a decode server (kv_consumer).

    python3 -m flash_vllm.launch python3 -m flash_vllm.pdrouter \
        --host 127.0.0.1 --port 18300 --prefill http://10.0.0.1:18310 --decode http://10.0.0.2:18311

Why our own (docs/MULTINODE.md): vLLM's wheel ships no router (its `toy_proxy_server.py` lives in
the repository's tests), and the packaged `vllm-router` takes the backends' key in argv, does not
check clients' keys, and answers health for itself. This one is small and does exactly vLLM's
NIXL flow, read from vLLM 0.33's sources (nixl/pull_scheduler.py, nixl/base_scheduler.py,
openai/*/protocol.py) and its tests' proxy:

1. prefill: the client's body with `kv_transfer_params` = {"do_remote_decode": true,
   "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
   "remote_host": null, "remote_port": null}, `stream` false, `max_tokens` 1 (and
   `max_completion_tokens` 1 when given), no `stream_options`, `min_tokens` /
   `min_completion_tokens` dropped (vLLM refuses min > max). The prefill server answers with
   `kv_transfer_params` (do_remote_prefill true, remote_engine_id, remote_request_id,
   remote_block_ids, remote_host, remote_port, tp_size, ...: its request_finished()).
2. decode: the client's own body plus those `kv_transfer_params`, streamed back as it comes.

Both requests carry the same `X-Request-Id` (the client's, or a new one) and the API key.
Errors: a 4xx from a server is the client's (passed through as it is); a 5xx, a refused
connection or a timeout is a 502 whose message and `stage` name the server that failed.
`/v1/messages` (Anthropic) takes the same path. `/health` is 200 only when both servers answer
200. `/metrics` is Prometheus text: the router's own `flash_router_*` families plus both servers'
families with a `stage` label, so dashboards and `flash test` read one endpoint. Other paths go
to the decode server.

The API key comes as on one box: `flash_vllm.launch` reads the mounted key file into
VLLM_API_KEY before exec; requests to /v1/* must carry it, and the router sends it to both servers.
Standard library plus prometheus_client (a vLLM dependency, so in every vLLM image).
"""

from __future__ import annotations

import argparse
import hmac
import http.client
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The Anthropic Messages API (Claude Code) takes the same handoff: vLLM 0.29-0.33's
# AnthropicMessagesRequest/Response carry kv_transfer_params (0.31+ skip the thinking-budget check
# on prefill legs for this reason).
PD_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/messages": "messages"}
# vLLM's tests' proxy sends exactly these (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py);
# base_scheduler.on_new_request() truncates the prompt when do_remote_decode is set, and
# pull_scheduler.request_finished() answers with the params the decode server needs.
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
# Answered by the router itself, without a key (as vLLM serves /health and /metrics); exact raw
# targets only, so no encoding or query string widens the exemption.
OPEN_PATHS = {"/health", "/metrics"}
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade",
               "proxy-authenticate", "proxy-authorization"}
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 3600.0  # a 500k-token prefill takes minutes on a Spark; a stall of an hour is a failure
HEALTH_TIMEOUT = 3.0


class StageError(Exception):
    """A server of one stage failed (5xx, refused, timed out, bad answer): the client gets a 502."""

    def __init__(self, stage: str, url: str, why: str):
        super().__init__(f"{stage} server {url} failed: {why}")
        self.stage, self.url, self.why = stage, url, why


class Backend:
    def __init__(self, stage: str, url: str):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"--{stage} {url!r} is not http://HOST:PORT")
        self.stage, self.url = stage, url.rstrip("/")
        self.host, self.port = parsed.hostname, parsed.port

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=CONNECT_TIMEOUT)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise StageError(self.stage, self.url, f"cannot connect ({exc.strerror or exc})") from None
        conn.sock.settimeout(timeout)
        return conn

    def request(self, method: str, path: str, body: bytes | None, headers: dict,
                timeout: float = READ_TIMEOUT) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self.connect(timeout)
        try:
            conn.request(method, path, body=body, headers=headers)
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            why = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise StageError(self.stage, self.url, why) from None

    def get(self, path: str, headers: dict, timeout: float = HEALTH_TIMEOUT) -> tuple[int, bytes]:
        conn, resp = self.request("GET", path, None, headers, timeout)
        try:
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise StageError(self.stage, self.url, f"{type(exc).__name__}: {exc}") from None
        finally:
            conn.close()


class Metrics:
    """The router's own families in a private registry, and the servers' families re-labelled."""

    def __init__(self, router: "Router"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("flash_router_requests", "Client requests by endpoint and outcome "
                                "(ok, client_error, prefill_error, decode_error, unauthorized, disconnected)",
                                ["endpoint", "outcome"], registry=self.registry)
        self.stage_requests = Counter("flash_router_stage_requests", "Requests sent to each stage's server by "
                                      "HTTP status (unreachable: no answer)", ["stage", "status"], registry=self.registry)
        self.stage_seconds = Histogram("flash_router_stage_seconds", "Seconds per stage: prefill = until the "
                                       "prefill server answered; decode = until the last byte of the decode answer",
                                       ["stage"], registry=self.registry,
                                       buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280))
        self.request_seconds = Histogram("flash_router_request_seconds", "Seconds per client request, end to end",
                                         ["endpoint"], registry=self.registry,
                                         buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280))
        self.in_flight = Gauge("flash_router_in_flight", "Client requests being served", registry=self.registry)
        self.kv_missing = Counter("flash_router_kv_params_missing", "Prefill answers without kv_transfer_params "
                                  "(the decode server then computes the prompt itself)", registry=self.registry)
        self.up = Gauge("flash_router_backend_up", "1 when the stage's server answered its last /health or "
                        "/metrics call with 200", ["stage"], registry=self.registry)
        for b in router.backends:
            self.up.labels(b.stage).set(0)
        self.router = router

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families
        from prometheus_client.core import Metric

        merged: dict[str, Metric] = {}
        for b in self.router.backends:
            try:
                status, body = b.get("/metrics", self.router.auth_headers())
            except StageError:
                status, body = 0, b""
            self.up.labels(b.stage).set(1 if status == 200 else 0)
            if status != 200:
                continue
            try:
                families = list(text_string_to_metric_families(body.decode("utf-8", "replace")))
            except ValueError:
                self.up.labels(b.stage).set(0)
                continue
            for fam in families:
                m = merged.get(fam.name)
                if m is None:
                    m = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    m.add_sample(s.name, {**s.labels, "stage": b.stage}, s.value, s.timestamp)
        return generate_latest(self.registry) + generate_latest(_Families(merged.values()))


class _Families:
    """A registry-shaped wrapper so generate_latest() writes already-collected families."""

    def __init__(self, families):
        self._families = list(families)

    def collect(self):
        return iter(self._families)


class Router:
    def __init__(self, prefill: str, decode: str, api_key: str | None):
        self.prefill, self.decode = Backend("prefill", prefill), Backend("decode", decode)
        self.backends = (self.prefill, self.decode)
        self.api_key = api_key or None
        self.metrics = Metrics(self)

    def auth_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


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


def error_body(code: int, message: str, err_type: str, stage: str | None = None) -> bytes:
    """vLLM's ErrorResponse shape ({"error": {"message", "type", "param", "code"}}), plus the stage."""
    err = {"message": message, "type": err_type, "param": None, "code": code}
    if stage:
        err["stage"] = stage
    return json.dumps({"error": err}).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "flash-pdrouter"
    router: Router  # set on the subclass built by serve()

    def log_message(self, fmt: str, *args) -> None:
        sys.stderr.write(f"pdrouter: {self.address_string()} {fmt % args}\n")

    # -- plumbing ------------------------------------------------------------------------------
    def send_bytes(self, code: int, body: bytes, ctype: str = "application/json", extra: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def authorized(self) -> bool:
        """Deny by default: with a key, every request needs it but GET/HEAD of exactly /health and
        /metrics, which the router answers itself. vLLM exempts everything outside /v1, but it reads
        the decoded path; a raw-path prefix test let `/%76%31/...` and absolute-form targets through
        here, and the router then forwarded them with its own key."""
        key = self.router.api_key
        if not key:
            return True
        if self.command in ("GET", "HEAD") and self.path in OPEN_PATHS:
            return True
        given = self.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, f"Bearer {key}".encode())  # constant time

    def origin_form(self) -> bool:
        """Only `/path` request targets: an absolute-form (`http://x/v1/...`) or `*` target is refused."""
        if self.path.startswith("/") and not self.path.startswith("//"):
            return True
        self.close_connection = True
        self.send_bytes(400, error_body(400, "the request target must be a path (origin-form)", "BadRequestError"))
        return False

    def refuse_unauthorized(self) -> None:
        # the body is never read: close the connection instead of leaving its bytes in the stream
        self.close_connection = True
        self.router.metrics.requests.labels(PD_PATHS.get(self.path.split("?", 1)[0], "other"), "unauthorized").inc()
        self.send_bytes(401, json.dumps({"error": "Unauthorized"}).encode())

    def upstream_headers(self, request_id: str | None = None) -> dict:
        h = {"Content-Type": "application/json", **self.router.auth_headers()}
        if request_id:
            h["X-Request-Id"] = request_id
        for name in ("Accept",):
            if self.headers.get(name):
                h[name] = self.headers[name]
        return h

    def relay(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, backend: Backend) -> bool:
        """Stream the server's answer to the client as it comes; False when the client went away.
        A server that breaks off after the headers cannot turn into a 502 any more: an SSE stream
        gets vLLM's in-stream error event, anything else is cut."""
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_HEADERS:
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sse = "text/event-stream" in (resp.getheader("Content-Type") or "")
        tail = b""
        try:
            while True:
                try:
                    chunk = resp.read1(65536)
                except (OSError, http.client.HTTPException) as exc:
                    chunk, broke = b"", f"broke off ({type(exc).__name__})"
                else:
                    broke = "" if chunk or not sse or b"[DONE]" in tail else "ended without [DONE]"
                if broke:  # vLLM ends every stream with `data: [DONE]`; anything else is a failure
                    if sse:
                        err = error_body(502, str(StageError(backend.stage, backend.url, broke)), "BadGateway",
                                         backend.stage)
                        self._chunk(b"data: " + err + b"\n\n")
                    self.close_connection = True
                    break
                if not chunk:
                    break
                tail = (tail + chunk)[-64:]
                self._chunk(chunk)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            return True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return False  # closing our side of the server's connection aborts the request there
        finally:
            conn.close()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    # -- routes --------------------------------------------------------------------------------
    def do_GET(self) -> None:
        if not self.origin_form():
            return
        if not self.authorized():
            return self.refuse_unauthorized()
        path = self.path.split("?", 1)[0]
        if path == "/health":
            return self.health()
        if path == "/metrics":
            return self.send_bytes(200, self.router.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
        self.passthrough()

    def do_POST(self) -> None:
        if not self.origin_form():
            return
        if not self.authorized():  # before any body byte is read
            return self.refuse_unauthorized()
        endpoint = PD_PATHS.get(self.path.split("?", 1)[0])
        if endpoint is None:
            return self.passthrough()
        m = self.router.metrics
        m.in_flight.inc()
        t0 = time.monotonic()
        outcome = "ok"
        try:
            outcome = self.disaggregated(endpoint)
        finally:
            m.in_flight.dec()
            m.requests.labels(endpoint, outcome).inc()
            m.request_seconds.labels(endpoint).observe(time.monotonic() - t0)

    def health(self) -> None:
        state = {}
        for b in self.router.backends:
            try:
                status, _ = b.get("/health", self.router.auth_headers())
                state[b.stage] = "ok" if status == 200 else f"HTTP {status}"
            except StageError as exc:
                state[b.stage] = exc.why
            self.router.metrics.up.labels(b.stage).set(1 if state[b.stage] == "ok" else 0)
        ok = all(v == "ok" for v in state.values())
        self.send_bytes(200 if ok else 503, json.dumps(state).encode())

    def passthrough(self) -> None:
        body = self.read_body() if self.command == "POST" else None
        b = self.router.decode
        try:
            conn, resp = b.request(self.command, self.path, body, self.upstream_headers())
        except StageError as exc:
            return self.send_bytes(502, error_body(502, str(exc), "BadGateway", exc.stage))
        self.relay(conn, resp, b)

    def disaggregated(self, endpoint: str) -> str:
        raw = self.read_body()
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            self.send_bytes(400, error_body(400, f"JSON decode error: {exc}", "BadRequestError"))
            return "client_error"
        if not isinstance(body, dict):
            self.send_bytes(400, error_body(400, "the request body must be a JSON object", "BadRequestError"))
            return "client_error"
        m = self.router.metrics
        rid = self.headers.get("X-Request-Id") or str(uuid.uuid4())
        path = self.path

        # 1. prefill: one token, and the KV handoff parameters back
        p = self.router.prefill
        t = time.monotonic()
        try:
            conn, resp = p.request("POST", path, json.dumps(prefill_body(body)).encode(), self.upstream_headers(rid))
            try:
                answer = resp.read()
            finally:
                conn.close()
        except (StageError, OSError, http.client.HTTPException) as exc:
            err = exc if isinstance(exc, StageError) else StageError("prefill", p.url, f"{type(exc).__name__}: {exc}")
            m.stage_requests.labels("prefill", "unreachable").inc()
            self.send_bytes(502, error_body(502, str(err), "BadGateway", "prefill"))
            return "prefill_error"
        m.stage_seconds.labels("prefill").observe(time.monotonic() - t)
        m.stage_requests.labels("prefill", str(resp.status)).inc()
        if 400 <= resp.status < 500:  # the client's mistake, said by the server that saw it
            self.send_bytes(resp.status, answer, resp.getheader("Content-Type") or "application/json")
            return "client_error"
        if resp.status != 200:
            self.send_bytes(502, error_body(502, str(StageError("prefill", p.url, f"HTTP {resp.status}: "
                                                                 f"{answer[:300].decode('utf-8', 'replace')}")),
                                            "BadGateway", "prefill"))
            return "prefill_error"
        try:
            kv = json.loads(answer).get("kv_transfer_params")
        except (ValueError, AttributeError):
            self.send_bytes(502, error_body(502, str(StageError("prefill", p.url, "its answer is not JSON")),
                                            "BadGateway", "prefill"))
            return "prefill_error"
        if kv:
            body["kv_transfer_params"] = kv
        else:
            m.kv_missing.inc()

        # 2. decode: the client's request with the handoff, streamed back as it comes
        d = self.router.decode
        t = time.monotonic()
        try:
            conn, resp = d.request("POST", path, json.dumps(body).encode(), self.upstream_headers(rid))
        except StageError as exc:
            m.stage_requests.labels("decode", "unreachable").inc()
            self.send_bytes(502, error_body(502, str(exc), "BadGateway", "decode"))
            return "decode_error"
        m.stage_requests.labels("decode", str(resp.status)).inc()
        if resp.status >= 500:
            try:
                answer = resp.read()
            except (OSError, http.client.HTTPException):
                answer = b""
            finally:
                conn.close()
            self.send_bytes(502, error_body(502, str(StageError("decode", d.url, f"HTTP {resp.status}: "
                                                                 f"{answer[:300].decode('utf-8', 'replace')}")),
                                            "BadGateway", "decode"))
            return "decode_error"
        status = resp.status
        delivered = self.relay(conn, resp, d)
        m.stage_seconds.labels("decode").observe(time.monotonic() - t)
        if not delivered:
            return "disconnected"
        return "client_error" if status >= 400 else "ok"


def serve(host: str, port: int, router: Router) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"router": router})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m flash_vllm.pdrouter", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18300)
    p.add_argument("--prefill", required=True, metavar="URL", help="the prefill server, http://HOST:PORT")
    p.add_argument("--decode", required=True, metavar="URL", help="the decode server, http://HOST:PORT")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        router = Router(ns.prefill, ns.decode, os.environ.get("VLLM_API_KEY"))
    except ValueError as exc:
        print(f"pdrouter: {exc}", file=sys.stderr)
        return 2
    server = serve(ns.host, ns.port, router)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"pdrouter: listening on {ns.host}:{ns.port}; prefill {router.prefill.url}, decode {router.decode.url}, "
          f"API key {'required' if router.api_key else 'not required'}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
