"""A vLLM prefill server (NixlConnector kv_producer) and a decode server (kv_consumer) on loopback,
real HTTP, answering what vLLM 0.33 answers and refusing what it would not be given by a correct
P/D router. Read from vLLM 0.33.0's wheel:

- `nixl/base_scheduler.py::on_new_request`: a request whose kv_transfer_params has
  `do_remote_decode` is a prefill-side request (its prompt truncated, `max_tokens = 1`);
  `do_remote_prefill` marks the decode side, tracked only with all of remote_engine_id,
  remote_request_id, remote_host, remote_port and tp_size.
- `nixl/pull_scheduler.py::request_finished` returns, on the prefill side, {do_remote_prefill:
  True, do_remote_decode: False, remote_block_ids, remote_engine_id, remote_request_id,
  remote_host, remote_port (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT), tp_size, dcp_size, pp_size,
  remote_num_tokens, remote_blocks_expiry_time, remote_registration_generation, transfer_mode}.
- `pull_scheduler.get_num_new_matched_tokens`: the decode side loads the prompt's KV when
  `do_remote_prefill` is set.
- `openai/completion/protocol.py`, `openai/chat_completion/protocol.py`: the response's
  `kv_transfer_params` field (the streaming final chunk carries it too, but a router asks the
  prefill side with stream=false).

What a test needs to see is recorded: every request body and its headers (`seen`). A request
that a faithful router would not send is answered 400 with the reason, so the router's test fails
on it. Faults: `status` (answer every generation with that HTTP status), `health` (the /health
status), `break_after` (decode: close the stream after that many chunks), `hold` (decode: wait on
this Event after the first chunk, to prove the router streams instead of buffering), `hold_answer`
(prefill or decode: before a non-streaming answer, wait on this Event while watching the connection;
a client that closes it sets `disconnected`, as vLLM aborts a request whose client left).
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SIDE_CHANNEL = ("10.0.0.1", 5600)  # the prefill box's VLLM_NIXL_SIDE_CHANNEL_HOST/PORT
DECODE_NEEDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size", "remote_block_ids")
WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]
METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="1.0",model_name="m"}} {n}
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {n}
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} {n}
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="m"}} {total}
"""


class FakeServer:
    def __init__(self, role: str, api_key: str | None = None, peer: "FakeServer | None" = None):
        assert role in ("prefill", "decode")
        self.role, self.api_key, self.peer = role, api_key, peer
        self.engine_id = str(uuid.uuid4())
        self.seen: list[dict] = []  # {"path", "body", "headers"}
        self.issued: dict[str, dict] = {}  # prefill: remote_request_id -> the kv_transfer_params answered
        self.status = 200
        self.health = 200
        self.break_after: int | None = None
        self.hold: threading.Event | None = None
        self.hold_answer: threading.Event | None = None
        self.token_gap_s = 0.01  # between streamed tokens (the load bench's --token-ms)
        self.disconnected = threading.Event()  # the client went away mid-answer
        self.n = 0
        self.conns: set = set()
        handler = type("H", (_Handler,), {"fake": self})
        # uvicorn's listen backlog (2048), as vLLM's API server has, not the standard library's 5
        server = type("S", (ThreadingHTTPServer,), {"request_queue_size": 2048})
        self.httpd = server(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> "FakeServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        """As a server process that dies: the listener and every open (keep-alive) connection close."""
        self.httpd.shutdown()
        self.httpd.server_close()
        for conn in list(self.conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- what vLLM would refuse from a P/D router --------------------------------------------------
    def problems(self, path: str, body: dict) -> list[str]:
        kv = body.get("kv_transfer_params")
        out = []
        if self.role == "prefill":
            if not isinstance(kv, dict) or kv.get("do_remote_decode") is not True:
                out.append(f"prefill request without kv_transfer_params.do_remote_decode=true: {kv!r}")
            elif kv.get("do_remote_prefill"):
                out.append("prefill request asks for do_remote_prefill")
            if body.get("stream"):
                out.append("prefill request with stream=true (the router must read kv_transfer_params from one JSON)")
            if body.get("max_tokens") != 1:
                out.append(f"prefill request with max_tokens={body.get('max_tokens')!r}, not 1")
            if "max_completion_tokens" in body and body["max_completion_tokens"] != 1:
                out.append(f"prefill request with max_completion_tokens={body['max_completion_tokens']!r}, not 1")
            if body.get("stream_options") is not None:  # vLLM: stream_options only with stream=true
                out.append("prefill request carries stream_options")
            for k in ("min_tokens", "min_completion_tokens"):  # SamplingParams refuses min_tokens > max_tokens
                if (body.get(k) or 0) > 1:
                    out.append(f"prefill request carries {k}={body[k]} (vLLM refuses min_tokens > max_tokens=1)")
        else:
            if not isinstance(kv, dict) or kv.get("do_remote_prefill") is not True:
                out.append(f"decode request without kv_transfer_params.do_remote_prefill=true: {kv!r}")
            else:
                missing = [k for k in DECODE_NEEDS if kv.get(k) is None]
                if missing:
                    out.append(f"decode request's kv_transfer_params lacks {missing}")
                elif self.peer is not None and self.peer.issued.get(kv["remote_request_id"]) != kv:
                    out.append("decode request's kv_transfer_params are not what the prefill server answered")
        return out

    def kv_answer(self, rid: str, n_prompt: int) -> dict:
        """pull_scheduler.request_finished() on the prefill side, field for field."""
        kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
              "remote_engine_id": self.engine_id, "remote_request_id": rid, "remote_host": SIDE_CHANNEL[0],
              "remote_port": SIDE_CHANNEL[1], "tp_size": 1, "dcp_size": 1, "pp_size": 1,
              "remote_num_tokens": n_prompt, "remote_blocks_expiry_time": None,
              "remote_registration_generation": 0, "transfer_mode": "pull"}
        self.issued[rid] = kv
        return kv


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeServer

    def log_message(self, *args) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.fake.conns.add(self.connection)

    def finish(self) -> None:
        self.fake.conns.discard(self.connection)
        super().finish()

    def send_json(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def authorized(self) -> bool:
        key = self.fake.api_key
        return not key or not self.path.startswith("/v1") or self.headers.get("Authorization") == f"Bearer {key}"

    def client_left(self, hold: threading.Event, limit: float = 10.0) -> bool:
        """Wait for `hold` while watching the connection, as vLLM's server notices a client that
        closes its connection: True when it did (readable with nothing to read = EOF)."""
        end = time.monotonic() + limit
        while not hold.is_set() and time.monotonic() < end:
            ready, _, _ = select.select([self.connection], [], [], 0.02)
            if ready:
                try:
                    if self.connection.recv(1, socket.MSG_PEEK) == b"":
                        return True
                except OSError:
                    return True
        return False

    def do_GET(self) -> None:
        f = self.fake
        if self.path == "/health":
            self.send_response(f.health)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/metrics":
            body = METRICS.format(running=0, prompt=f.n * 5, n=f.n, total=f.n * 0.5).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif not self.authorized():
            self.send_json(401, {"error": "Unauthorized"})
        elif self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": f.role}]})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        f = self.fake
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        f.seen.append({"path": self.path, "body": body, "headers": dict(self.headers)})
        if not self.authorized():
            return self.send_json(401, {"error": "Unauthorized"})
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self.send_json(404, {"detail": "Not Found"})
        if f.status != 200:
            return self.send_json(f.status, {"error": {"message": f"fake {f.role} says {f.status}", "type": "X",
                                                       "param": None, "code": f.status}})
        if body.get("max_tokens") == -1:  # a request vLLM's protocol validation refuses
            return self.send_json(400, {"error": {"message": "max_tokens must be at least 1, got -1.",
                                                  "type": "BadRequestError", "param": "max_tokens", "code": 400}})
        bad = f.problems(self.path, body)
        if bad:
            return self.send_json(400, {"error": {"message": "; ".join(bad), "type": "BadRequestError",
                                                  "param": "kv_transfer_params", "code": 400}})
        f.n += 1
        chat = self.path.endswith("chat/completions")
        rid = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "created": int(time.time()), "model": body.get("model", "m")}
        if f.role == "prefill" and f.hold_answer is not None and self.client_left(f.hold_answer):
            f.disconnected.set()
            return
        if f.role == "prefill":
            kv = f.kv_answer(f"{base['id']}-0", 5)
            choice = ({"index": 0, "message": {"role": "assistant", "content": WORDS[0]}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": WORDS[0], "finish_reason": "length"})
            return self.send_json(200, {**base, "object": "chat.completion" if chat else "text_completion",
                                        "choices": [choice], "kv_transfer_params": kv,
                                        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
        if f.hold_answer is not None and not body.get("stream") and self.client_left(f.hold_answer):
            f.disconnected.set()
            return
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or len(WORDS))
        words = [WORDS[i % len(WORDS)] for i in range(n)]
        if not body.get("stream"):
            text = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            return self.send_json(200, {**base, "object": "chat.completion" if chat else "text_completion",
                                        "choices": [choice], "kv_transfer_params": None,
                                        "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
        self.send_response(200)  # uvicorn streams a StreamingResponse chunked, and keeps the connection
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        try:
            for i, w in enumerate(words):
                if f.break_after is not None and i >= f.break_after:
                    self.connection.shutdown(2)
                    return
                delta = {"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} if chat \
                    else {"choices": [{"index": 0, "text": w, "finish_reason": None}]}
                chunk(f"data: {json.dumps({**base, **delta})}\n\n".encode())
                if i == 0 and f.hold is not None:
                    f.hold.wait(10)
                time.sleep(f.token_gap_s)
            chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            f.disconnected.set()


def pair(api_key: str | None = None) -> tuple[FakeServer, FakeServer]:
    p = FakeServer("prefill", api_key).start()
    d = FakeServer("decode", api_key, peer=p).start()
    return p, d
