"""The container healthcheck probes the address vLLM listens on (issue 14): with NETWORK=host and
a specific BIND, vLLM listens on that address only, and a probe of 127.0.0.1 would keep the
container "unhealthy" forever. Proven by running the rendered healthcheck argv against a real
HTTP server listening on 127.0.0.2 only (a loopback address that is not 127.0.0.1)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from test_runspec import spec_for


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def server_on_127_0_0_2():
    try:
        srv = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Health)
    except OSError as exc:  # pragma: no cover - every Linux routes 127/8 to lo
        pytest.fail(f"cannot listen on 127.0.0.2: {exc}")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()


def run_healthcheck(test: list[str]) -> int:
    assert test[:4] == ["CMD", "python3", "-m", "flash_vllm.launch"]
    return subprocess.run([sys.executable, *test[2:]], timeout=30).returncode


def test_host_network_probes_the_bind_address(server_on_127_0_0_2):
    port = server_on_127_0_0_2
    s = spec_for("default", NETWORK="host", BIND="127.0.0.2", PORT=str(port))
    assert "--host" in s.command and s.command[s.command.index("--host") + 1] == "127.0.0.2"
    assert s.healthcheck["test"][-2:] == [str(port), "127.0.0.2"]
    assert run_healthcheck(s.healthcheck["test"]) == 0


def test_bridge_and_wildcard_keep_the_loopback_probe(server_on_127_0_0_2):
    for over in ({"NETWORK": "bridge", "BIND": "192.168.7.2", "API_KEY": "on"},
                 {"NETWORK": "host", "BIND": "0.0.0.0", "API_KEY": "on"}, {"NETWORK": "host"}):
        test = spec_for("default", **over).healthcheck["test"]
        assert test[4:6] == ["--health", test[5]] and len(test) == 6, over  # 127.0.0.1 inside the container
    # and a probe of the wrong address really fails (the check above is not vacuous)
    port = server_on_127_0_0_2
    assert run_healthcheck(["CMD", "python3", "-m", "flash_vllm.launch", "--health", str(port)]) == 1
