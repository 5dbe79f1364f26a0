"""The prefill/decode router of a `pd` deployment: one OpenAI- and Anthropic-compatible endpoint in
front of a vLLM prefill server (NixlConnector kv_producer) and one or more decode servers
(kv_consumer; `--decode` once per server, pd3/pd4: each request to the one with the fewest
outstanding).

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
- here: the routes, the listening socket, the workers and the command line.

Workers (`--workers N`, the ROUTER_WORKERS setting; 0: min(4, CPU cores)): one event loop spends
~1.4 ms of CPU per routed request, so at 200 simultaneous requests they queue behind each other
(issue 34: p99 2.65x direct on a 16-core host). With N > 1 this process is a supervisor: it binds
the socket, forks N workers that all accept on it (each its own uvicorn, Flow and health watcher;
each picks decode servers by its own outstanding counts; the servers' up/down verdicts are shared),
and serves nothing itself. The edge is
the same in every worker (key before body, header/body timers per connection); the connection cap
is shared (httpedge.Tally). /metrics combines every worker (pdmetrics: prometheus_client's
multiprocess mode in a private directory, removed at exit). SIGTERM/SIGINT: every worker gets
SIGTERM (uvicorn's graceful shutdown), stragglers SIGKILL after WORKER_GRACE s, exit 0. A worker
that dies on its own is replaced at once; more than CRASH_LIMIT deaths within CRASH_WINDOW s stop
the whole router with exit 1 (a restart policy sees it), never a router silently short of workers.

Routes: POST /v1/completions, /v1/chat/completions, /v1/messages take the P/D flow. GET /health is
200 only when every server answers 200 (503 otherwise; the body names each server's state:
`prefill`, `decode` or `decode1`..`decodeN`). /metrics: the router's `flash_router_*` families plus
every server's with `stage` and `server` labels. Everything else goes to a decode server. A client that leaves closes the upstream request (streaming or not), so vLLM
aborts it. The API key comes as on one box: `flash_vllm.launch` reads the mounted key file into
VLLM_API_KEY before exec; the router requires it from clients and sends it to both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace

from .httpedge import Limits, error_body
from .pdflow import HEALTH_INTERVAL, PD_PATHS, PREFILL_KV_PARAMS, Flow, StageError, prefill_body  # noqa: F401

__all__ = ["PD_PATHS", "PREFILL_KV_PARAMS", "prefill_body", "Router", "build_app", "serve", "main"]

MAX_AUTO_WORKERS = 4
WORKER_GRACE = 10.0  # uvicorn's graceful shutdown is 5 s; then the supervisor kills
CRASH_LIMIT, CRASH_WINDOW = 5, 60.0
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class Router:
    """One router's state: the servers (the flow), the key, the edge's limits, the metrics."""

    def __init__(self, prefill: str, decode: str | list[str], api_key: str | None, limits: Limits | None = None,
                 health_interval: float = HEALTH_INTERVAL, shared_health=None):
        from .pdflow import decode_backends
        from .pdmetrics import Metrics

        self.metrics = Metrics([("prefill", "prefill")] + [("decode", b.name) for b in decode_backends(decode)])
        self.flow = Flow(prefill, decode, api_key, self.metrics, shared_health)
        self.prefill, self.decodes, self.backends = self.flow.prefill, self.flow.decodes, self.flow.backends
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
        target_server = flow.pick() or flow.decodes[0]  # all down: the first, whose failure is then named
        return Relay(lambda send: flow.relay(target_server, request.method, target.decode("latin-1"), data, hdrs, send),
                     count("other", time.monotonic()))

    async def health(request: Request):
        states = await asyncio.gather(*(flow.check(b) for b in flow.backends))
        state = {b.name: s for b, s in zip(flow.backends, states)}
        ok = all(s == "ok" for s in state.values())
        return Response(json.dumps(state), 200 if ok else 503, media_type="application/json")

    async def metrics(request: Request):
        async def one(b):
            try:
                return await flow.get(b, "/metrics")
            except StageError:
                return None
        answers = await asyncio.gather(*(one(b) for b in flow.backends))
        text = m.exposition({(b.stage, b.name): a for b, a in zip(flow.backends, answers)})
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


def server_for(router: Router, sock: socket.socket, tally=None):
    import uvicorn

    from .httpedge import edge_protocol

    lim = router.limits
    config = uvicorn.Config(build_app(router), http=edge_protocol(lim, tally), loop="uvloop", ws="none", lifespan="on",
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
    p.add_argument("--decode", required=True, action="append", metavar="URL",
                   help="a decode server, http://HOST:PORT; once per server (each request goes to the one "
                        "with the fewest outstanding)")
    p.add_argument("--max-body", type=int, default=d.max_body, metavar="BYTES", help="largest request body (413 above)")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout, metavar="S",
                   help="seconds a connection has to send its request headers")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout, metavar="S",
                   help="seconds a request body may stall (408)")
    p.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help="open connections (more are closed at accept; requests past it get 503)")
    p.add_argument("--health-interval", type=float, default=HEALTH_INTERVAL, metavar="S",
                   help="seconds between health checks of every server")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help=f"worker processes accepting on the one socket (0: min({MAX_AUTO_WORKERS}, CPU cores); "
                        "1: this process serves)")
    return p.parse_args(argv)


def auto_workers(n: int) -> int:
    if n:
        return n
    try:
        cores = len(os.sched_getaffinity(0))  # a container's cpuset, not the host's count
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_WORKERS, cores))


def _log(msg: str) -> None:
    print(f"pdrouter: {msg}", file=sys.stderr, flush=True)


def _worker(ns: argparse.Namespace, limits: Limits, sock: socket.socket, slots, index: int, health=None) -> None:
    """One worker (a forked child): its own Router, uvicorn and event loop on the shared socket."""
    from .httpedge import Tally

    # the supervisor's handlers are not this process's; the signals were blocked across the fork, so
    # a SIGTERM sent before this point is delivered now and ends the worker (not the parent's handler)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    router = Router(ns.prefill, ns.decode, os.environ.get("VLLM_API_KEY"), limits, ns.health_interval, health)
    server = server_for(router, sock, Tally(slots, index))
    server.run(sockets=[sock])
    if not server.started:  # uvicorn returns quietly when its startup failed
        sys.exit(3)


def supervise(ns: argparse.Namespace, limits: Limits, sock: socket.socket, workers: int, metrics_dir: str) -> int:
    """Fork `workers` workers on `sock`, replace one that dies, stop all on SIGTERM/SIGINT."""
    import multiprocessing
    from multiprocessing.connection import wait

    from prometheus_client.multiprocess import mark_process_dead

    ctx = multiprocessing.get_context("fork")  # the socket, the imports and the slot array are inherited
    slots = ctx.RawArray("l", workers)
    # each server's up/down verdict, shared: a decode server one worker saw go down is down for all
    health = ctx.RawArray("b", 1 + len(ns.decode))  # --decode is a list (append)
    procs: dict[int, multiprocessing.Process] = {}
    stopping: list[float] = []  # when SIGTERM/SIGINT came
    crashes: list[float] = []
    failed = False

    def start(i: int) -> None:
        if stopping:  # a stop came while workers were being started: start no more
            return
        p = ctx.Process(target=_worker, args=(ns, limits, sock, slots, i, health), name=f"pdrouter-worker{i}",
                        daemon=False)
        # blocked across the fork: a stop signal that lands in the child before it has reset the handlers
        # would otherwise run the supervisor's handler there and leave the worker serving; and until
        # the worker is in procs, where a stop delivered at the unblock finds it
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            p.start()
            procs[i] = p
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        # a signal that arrived before the block is handled by Python at its next bytecode, which may be
        # inside p.start() before the fork: stop_all then ran without this worker, so it is told here
        if stopping:
            os.kill(p.pid, signal.SIGTERM)

    def stop_all() -> None:
        for p in procs.values():
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def on_signal(signum, frame) -> None:
        if not stopping:
            stopping.append(time.monotonic())
            stop_all()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for i in range(workers):
        start(i)
    while procs:
        wait([p.sentinel for p in procs.values()], timeout=0.5)
        for i, p in list(procs.items()):
            if p.exitcode is None:
                continue
            del procs[i]
            mark_process_dead(p.pid, metrics_dir)  # its live gauges (in flight, outstanding) leave the sums
            slots[i] = 0  # its connections are gone with it
            if stopping:
                continue
            now = time.monotonic()
            crashes[:] = [t for t in crashes if now - t < CRASH_WINDOW] + [now]
            if len(crashes) > CRASH_LIMIT:
                _log(f"worker {i} (pid {p.pid}) exited with {p.exitcode}: {len(crashes)} worker deaths in "
                     f"{CRASH_WINDOW:g} s, stopping the router")
                failed = True
                stopping.append(now)
                stop_all()
                continue
            _log(f"worker {i} (pid {p.pid}) exited with {p.exitcode}; starting a new one")
            start(i)
        if stopping and time.monotonic() - stopping[0] > WORKER_GRACE:
            for p in procs.values():
                if p.exitcode is None:
                    p.kill()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    limits = Limits(max_body=ns.max_body, header_timeout=ns.header_timeout, body_timeout=ns.body_timeout,
                    max_connections=ns.max_connections)
    metrics_dir = None
    try:
        if not (0 <= ns.port <= 65535):
            raise ValueError(f"--port {ns.port} is not in [0, 65535]")
        for name in ("max_body", "header_timeout", "body_timeout", "max_connections", "health_interval"):
            if not getattr(ns, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(ns, name)} must be above 0")
        if not 0 <= ns.workers <= 256:
            raise ValueError(f"--workers {ns.workers} is not in [0, 256]")
        workers = auto_workers(ns.workers)
        from .pdflow import Backend, decode_backends

        # the URLs checked here; with workers each builds its own Router (and metrics) after the fork
        prefill, decodes = Backend("prefill", ns.prefill), decode_backends(ns.decode)
        key = os.environ.get("VLLM_API_KEY") or None
        router = Router(ns.prefill, ns.decode, key, limits, ns.health_interval) if workers == 1 else None
        sock = listen(ns.host, ns.port, limits.backlog)
    except ValueError as exc:
        _log(str(exc))
        return 2
    if workers > 1:
        # before anything imports prometheus_client: it picks its value class at import. A fresh
        # private directory, so no file of an earlier run (or of another router) is summed in.
        metrics_dir = tempfile.mkdtemp(prefix="flash-router-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        # the HTTP stack imported before we say we listen (and, with workers, before they fork, so
        # each starts without importing it again)
        if router is not None:
            server = server_for(router, sock)
        else:
            import aiohttp  # noqa: F401
            import prometheus_client  # noqa: F401
            import starlette.routing  # noqa: F401
            import uvicorn  # noqa: F401
            import uvloop  # noqa: F401

            from .httpedge import edge_protocol
            edge_protocol(limits)
        host, port = sock.getsockname()[:2]
        _log(f"listening on {host}:{port}; prefill {prefill.url}, decode {', '.join(b.url for b in decodes)}, "
             f"API key {'required' if key else 'not required'}, {workers} worker{'s' if workers > 1 else ''}")
        if router is not None:
            server.run(sockets=[sock])  # SIGTERM/SIGINT: uvicorn's graceful shutdown
            return 0
        return supervise(ns, limits, sock, workers, metrics_dir)
    finally:
        if metrics_dir:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
