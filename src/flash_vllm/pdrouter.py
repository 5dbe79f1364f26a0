"""The prefill/decode router of a `pd` deployment: one OpenAI- and Anthropic-compatible endpoint in
front of a vLLM prefill server (NixlConnector kv_producer) and a decode server (kv_consumer).

    python3 -m flash_vllm.launch python3 -m flash_vllm.pdrouter \
        --host 127.0.0.1 --port 18300 --prefill http://10.0.0.1:18310 --decode http://10.0.0.2:18311

Why our own (docs/MULTINODE.md has the evidence): vLLM's wheel ships no router, and the packaged
`vllm-router` (0.1.17) does the NIXL flow but checks no client key (it forwards any request with the
deployment's key), answers /health for itself and spends a prefill when the decode server is down.

Built on the HTTP stack vLLM serves with, so the image needs nothing new: uvicorn (httptools,
uvloop) and Starlette for the endpoint, aiohttp for the two upstream legs, prometheus_client for
/metrics; all imported when the router starts (the plugin never imports this module).
- httpedge.py: the key, framing, size, time and connection limits, before any body byte is read;
- pdflow.py: the prefill -> decode flow, the servers' health, the relay;
- pdmetrics.py: /metrics;
- here: the routes, the listening socket and the command line.

Routes: POST /v1/completions, /v1/chat/completions, /v1/messages take the P/D flow. GET /health is
200 only when both servers answer 200 (503 with each server's state otherwise). /metrics: the
router's `flash_router_*` families plus both servers' with a `stage` label. Everything else goes to
the decode server. A client that leaves closes the upstream request (streaming or not), so vLLM
aborts it. The API key comes as on one box: `flash_vllm.launch` reads the mounted key file into
VLLM_API_KEY before exec; the router requires it from clients and sends it to both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
from dataclasses import replace

from .httpedge import Limits, error_body
from .pdflow import HEALTH_INTERVAL, PD_PATHS, PREFILL_KV_PARAMS, Flow, StageError, prefill_body  # noqa: F401

__all__ = ["PD_PATHS", "PREFILL_KV_PARAMS", "prefill_body", "Router", "build_app", "serve", "main"]


class Router:
    """One router's state: both servers (the flow), the key, the edge's limits, the metrics."""

    def __init__(self, prefill: str, decode: str, api_key: str | None, limits: Limits | None = None,
                 health_interval: float = HEALTH_INTERVAL):
        from .pdmetrics import Metrics

        self.metrics = Metrics()
        self.flow = Flow(prefill, decode, api_key, self.metrics)
        self.prefill, self.decode, self.backends = self.flow.prefill, self.flow.decode, self.flow.backends
        self.api_key = api_key or None
        self.limits = replace(limits or Limits(), api_key=self.api_key)
        self.health_interval = health_interval


class Relay:
    """An ASGI response that runs `job(send)` and watches the client: when it leaves before the
    answer is complete, the job is cancelled, which closes the upstream connection."""

    def __init__(self, job, done):
        self.job, self.done = job, done

    async def __call__(self, scope, receive, send):
        finished = False

        async def tracked(msg):
            nonlocal finished
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                finished = True

        async def client_left():
            while (await receive())["type"] != "http.disconnect":
                pass

        task = asyncio.ensure_future(self.job(tracked))
        watch = asyncio.ensure_future(client_left())
        outcome = "disconnected"
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task.done() or finished:  # uvicorn says "disconnect" once a response is complete, too
                outcome = await task
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self.done(outcome)


def build_app(router: Router):
    """The ASGI app: Starlette's routing (no exception middleware: the edge answers its own
    refusals) inside the edge's Guard."""
    from contextlib import asynccontextmanager

    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import Response
    from starlette.routing import Route
    from starlette.routing import Router as Routes

    from .httpedge import Guard

    flow, m = router.flow, router.metrics

    def count(endpoint: str, t0: float):
        m.in_flight.inc()

        def done(outcome: str) -> None:
            m.in_flight.dec()
            m.requests.labels(endpoint, outcome).inc()
            m.request_seconds.labels(endpoint).observe(time.monotonic() - t0)
        return done

    def bad_request(message: str, anthropic: bool) -> Response:
        kind = "invalid_request_error" if anthropic else "BadRequestError"
        return Response(error_body(400, message, kind, anthropic=anthropic), 400, media_type="application/json")

    async def pd(request: Request):
        path = request.url.path
        endpoint = PD_PATHS[path]
        anthropic = endpoint == "messages"
        try:
            raw = await request.body()
        except ClientDisconnect:
            m.requests.labels(endpoint, "disconnected").inc()
            return Response(status_code=499)  # nobody is there to read it
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as exc:  # RecursionError: 100k nested '[' and the like
            m.requests.labels(endpoint, "client_error").inc()
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            return bad_request(f"JSON decode error: {why}", anthropic)
        if not isinstance(body, dict):
            m.requests.labels(endpoint, "client_error").inc()
            return bad_request("the request body must be a JSON object", anthropic)
        client = {k: request.headers[k] for k in ("accept", "x-request-id") if k in request.headers}
        return Relay(lambda send: flow.disaggregated(path, body, client, send), count(endpoint, time.monotonic()))

    async def passthrough(request: Request):
        try:
            data = await request.body() if request.method in ("POST", "PUT", "PATCH") else None
        except ClientDisconnect:
            return Response(status_code=499)
        target = request.scope.get("raw_path") or request.url.path.encode()
        if request.scope.get("query_string"):
            target += b"?" + request.scope["query_string"]
        hdrs = flow.headers({k: request.headers[k] for k in ("accept",) if k in request.headers}, None)
        if "content-type" in request.headers:
            hdrs["Content-Type"] = request.headers["content-type"]
        elif data is None:
            hdrs.pop("Content-Type")
        return Relay(lambda send: flow.relay(flow.decode, request.method, target.decode("latin-1"), data, hdrs, send),
                     count("other", time.monotonic()))

    async def health(request: Request):
        states = await asyncio.gather(*(flow.check(b) for b in flow.backends))
        state = {b.stage: s for b, s in zip(flow.backends, states)}
        ok = all(s == "ok" for s in state.values())
        return Response(json.dumps(state), 200 if ok else 503, media_type="application/json")

    async def metrics(request: Request):
        async def one(b):
            try:
                return await flow.get(b, "/metrics")
            except StageError:
                return None
        answers = await asyncio.gather(*(one(b) for b in flow.backends))
        text = m.exposition({b.stage: a for b, a in zip(flow.backends, answers)})
        return Response(text, 200, media_type="text/plain; version=0.0.4; charset=utf-8")

    @asynccontextmanager
    async def lifespan(app):
        await flow.start(router.health_interval)
        try:
            yield
        finally:
            await flow.close()

    routes = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
              *(Route(p, pd, methods=["POST"]) for p in PD_PATHS),
              Route("/{rest:path}", passthrough, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]

    def refused(path: str, why: str) -> None:
        m.requests.labels(PD_PATHS.get(path, "other"), why).inc()

    return Guard(Routes(routes, redirect_slashes=False, lifespan=lifespan), router.limits, refused)


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """The listening socket: IPv4 or IPv6 (`::1`, `fd00::1`; `::` also takes IPv4), with a real
    backlog. A host that does not resolve or cannot be bound is a ValueError naming it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} is not an address of this machine ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if host == "::" else 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def server_for(router: Router, sock: socket.socket):
    import uvicorn

    from .httpedge import edge_protocol

    lim = router.limits
    config = uvicorn.Config(build_app(router), http=edge_protocol(lim), loop="uvloop", ws="none", lifespan="on",
                            backlog=lim.backlog, timeout_keep_alive=lim.keepalive_timeout,
                            limit_concurrency=lim.max_connections, timeout_graceful_shutdown=5,
                            access_log=False, log_level="warning", server_header=False)
    return uvicorn.Server(config)


class Running:
    """A router serving on a thread of this process (tests, benchmarks); stop() ends it."""

    def __init__(self, router: Router, sock: socket.socket):
        self.router, self.sock = router, sock
        self.server = server_for(router, sock)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        host, self.port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self, timeout: float = 10) -> "Running":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the router did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def serve(host: str, port: int, router: Router) -> Running:
    return Running(router, listen(host, port, router.limits.backlog)).start()


def parse_args(argv: list[str]) -> argparse.Namespace:
    d = Limits()
    p = argparse.ArgumentParser(prog="python3 -m flash_vllm.pdrouter", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (IPv4 or IPv6)")
    p.add_argument("--port", type=int, default=18300, help="port to listen on (0: any free port)")
    p.add_argument("--prefill", required=True, metavar="URL", help="the prefill server, http://HOST:PORT")
    p.add_argument("--decode", required=True, metavar="URL", help="the decode server, http://HOST:PORT")
    p.add_argument("--max-body", type=int, default=d.max_body, metavar="BYTES", help="largest request body (413 above)")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout, metavar="S",
                   help="seconds a connection has to send its request headers")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout, metavar="S",
                   help="seconds a request body may stall (408)")
    p.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help="open connections (more are closed at accept; requests past it get 503)")
    p.add_argument("--health-interval", type=float, default=HEALTH_INTERVAL, metavar="S",
                   help="seconds between health checks of both servers")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    limits = Limits(max_body=ns.max_body, header_timeout=ns.header_timeout, body_timeout=ns.body_timeout,
                    max_connections=ns.max_connections)
    try:
        if not (0 <= ns.port <= 65535):
            raise ValueError(f"--port {ns.port} is not in [0, 65535]")
        for name in ("max_body", "header_timeout", "body_timeout", "max_connections", "health_interval"):
            if not getattr(ns, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(ns, name)} must be above 0")
        router = Router(ns.prefill, ns.decode, os.environ.get("VLLM_API_KEY"), limits, ns.health_interval)
        sock = listen(ns.host, ns.port, limits.backlog)
    except ValueError as exc:
        print(f"pdrouter: {exc}", file=sys.stderr)
        return 2
    server = server_for(router, sock)  # the HTTP stack imported before we say we listen
    host, port = sock.getsockname()[:2]
    print(f"pdrouter: listening on {host}:{port}; prefill {router.prefill.url}, decode {router.decode.url}, "
          f"API key {'required' if router.api_key else 'not required'}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])  # SIGTERM/SIGINT: uvicorn's graceful shutdown
    return 0


if __name__ == "__main__":
    sys.exit(main())
