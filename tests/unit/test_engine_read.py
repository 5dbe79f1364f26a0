"""The read-only Engine API client against a fake daemon on a real unix socket."""

from __future__ import annotations

import json
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import UnixStreamServer

import pytest

from flash_cli import engine, engine_read
from flash_cli.errors import DockerUnavailable

INSPECT = {"Id": "c0ffee" * 8, "Name": "/box", "Config": {"Labels": {"org.flash.name": "box", "org.flash.port": "18300"},
                                                          "Tty": False},
           "State": {"Status": "exited", "ExitCode": 3, "OOMKilled": False, "StartedAt": "t0"}}


class Handler(BaseHTTPRequestHandler):
    seen: list[str] = []

    def address_string(self):  # unix sockets have no peer address
        return "unix"

    def log_message(self, *a):
        pass

    def do_GET(self):
        Handler.seen.append(self.path)
        if self.path.startswith("/v1.41/containers/json?"):
            body = json.dumps([{"Id": INSPECT["Id"]}]).encode() if "box" in self.path else b"[]"
        elif self.path.startswith(f"/v1.41/containers/{INSPECT['Id']}/json"):
            body = json.dumps(INSPECT).encode()
        elif "/logs?" in self.path:
            lines = [b"line one\n", b"line two\n", b"EngineCore failed\n"]
            body = b"".join(struct.pack(">BxxxI", 1 + i % 2, len(x)) + x for i, x in enumerate(lines))
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class UnixHTTPServer(UnixStreamServer, ThreadingHTTPServer):
    pass


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    sock = str(tmp_path / "docker.sock")
    srv = UnixHTTPServer(sock, Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
    yield Handler
    srv.shutdown()


def test_find_by_label_state_and_demuxed_logs(daemon):
    c = engine_read.find("box")
    assert c.name == "box" and c.labels["org.flash.port"] == "18300" and c.short_id == INSPECT["Id"][:12]
    assert any('"org.flash.name=box"' in p.replace("%22", '"').replace("%3D", "=") for p in daemon.seen)
    st = engine.state(c)
    assert st.status == "exited" and st.exit_code == 3
    assert engine.tail(c, 3) == ["line one", "line two", "EngineCore failed"]
    assert engine_read.find("nobody") is None


def test_unreachable_daemon_is_a_typed_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'absent.sock'}")
    with pytest.raises(DockerUnavailable) as err:
        engine_read.find("box")
    assert str(err.value).startswith(f"Docker Engine unreachable at unix://{tmp_path / 'absent.sock'}: ")
    assert str(err.value).endswith("No such file or directory")


def test_tls_hosts_are_left_to_the_sdk(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "ssh://me@host")
    with pytest.raises(LookupError):
        engine_read.find("box")


def test_the_cause_is_found_through_docker_pys_wrappers():
    """docker-py raises DockerException(... ConnectionError(ProtocolError('Connection aborted.',
    FileNotFoundError(2, ...)))): the user reads the FileNotFoundError's reason, nothing else."""
    from flash_cli.errors import os_cause, root_cause

    inner = FileNotFoundError(2, "No such file or directory")
    proto = Exception("Connection aborted.", inner)
    try:
        try:
            raise ConnectionError(proto)
        except ConnectionError as exc:
            raise RuntimeError("Error while fetching server API version: ('Connection aborted.', ...)") from exc
    except RuntimeError as wrapped:
        assert os_cause(wrapped) is inner and root_cause(wrapped) == "No such file or directory"
    assert root_cause(ValueError("first line\nsecond")) == "first line" and os_cause(ValueError("x")) is None
    err = DockerUnavailable.unreachable("unix:///x.sock", inner)
    assert str(err) == "Docker Engine unreachable at unix:///x.sock: No such file or directory" and err.exit_code == 3
