"""Start the stand-in server as a real process on a free loopback port (for host-side tests).

    from harness import StandIn            # tests add tests/standin to sys.path
    with StandIn(faults="slow", env={"VLLM_PLE_MMAP": "1"}) as s:
        requests.get(s.url + "/health")
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVER = Path(__file__).with_name("server.py")
READY = re.compile(r"Starting vLLM API server 0 on http://[^:]+:(\d+)")


class StandIn:
    def __init__(self, *args: str, faults: str = "", env: dict | None = None, model: str = "qwen3.8-flash-next",
                 boot_seconds: float = 0.1, timeout: float = 20.0):
        self.argv = [sys.executable, str(SERVER), "serve", "/models/standin", "--host", "127.0.0.1", "--port", "0",
                     "--served-model-name", model, *args]
        self.env = {**os.environ, "STANDIN_SKIP_MODEL_CHECK": "1", "STANDIN_BOOT_SECONDS": str(boot_seconds),
                    "STANDIN_FAULTS": faults, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.timeout = timeout
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "StandIn":
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                m = READY.search(line)
                if m:
                    self.port = int(m.group(1))
                if "Application startup complete" in line:
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(self.timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("stand-in did not start:\n" + "\n".join(self.lines[-20:]))
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode if self.proc else None

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_for_line(self, pattern: str, timeout: float = 10.0) -> str:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.lines):
                if rx.search(line):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no log line matching {pattern!r}; last lines:\n" + "\n".join(self.lines[-10:]))
