"""The memory watchdog (issue 36): stop the server gracefully while memory pressure says the box is
about to lock, before the kernel does it for us.

    python3 -m flash_common.memguard --name NAME [--source host|container] [--threshold PCT]
                                     [--hold S] [--interval S] [--grace S] [--metrics HOST:PORT]

It follows the container NAME (found by its label org.flash.name, through the Docker API socket)
and reads PSI `full avg10` every --interval seconds: the share of the last 10 s in which every
non-idle task was stalled on memory (direct reclaim, refaults of evicted pages). `host` reads
/proc/pressure/memory (the whole box: on a 128 GB unified Spark another process squeezing the pool
freezes the box just as well); `container` reads the server's own cgroup `memory.pressure` (a box
where the server runs under a memory limit). Once the value has stayed above --threshold for
--hold seconds, it stops the server with the Engine API's stop (SIGTERM, then SIGKILL after
--grace s: `docker stop -t GRACE`, so Docker's unless-stopped policy does not bring it back into
the same pressure) and says why on stdout (`docker logs NAME-guard`, which `flash status` reads)
as a `flash-guard-event {json}` line. A server stopped by hand is left alone; a server started
again re-arms the guard. --metrics serves its state in the Prometheus text format.

Standard library only: it runs in the server's own image (a sidecar container) and on the host.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote

EVENT = "flash-guard-event"  # stdout marker of a JSON record (status reads the last one)
LABEL = "org.flash.name"
API = "/v1.41"
HOST_PSI = "/proc/pressure/memory"
# Where a container's cgroup v2 `memory.pressure` lives on the host, by cgroup driver and layout:
# cgroupfs on pure v2, cgroupfs on a hybrid v1/v2 host (the unified tree), systemd's docker scope.
CGROUP_PATTERNS = ("{root}/docker/{id}/memory.pressure", "{root}/unified/docker/{id}/memory.pressure",
                   "{root}/system.slice/docker-{id}.scope/memory.pressure",
                   "{root}/unified/system.slice/docker-{id}.scope/memory.pressure")


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """`some avg10=0.12 avg60=… avg300=… total=…` lines → {"some": {...}, "full": {...}}."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        kind, *pairs = line.split()
        vals = {}
        for pair in pairs:
            k, _, v = pair.partition("=")
            try:
                vals[k] = float(v)
            except ValueError:
                raise ValueError(f"not a PSI line: {line!r}") from None
        if kind in ("some", "full"):
            out[kind] = vals
    if "some" not in out:
        raise ValueError(f"no 'some' line in {text[:80]!r}")
    return out


def full_avg10(path: str) -> float:
    """PSI `full avg10` of one pressure file (percent)."""
    with open(path, encoding="ascii") as fh:
        psi = parse_psi(fh.read())
    if "full" not in psi:  # kernels before 5.x had no full line for the whole system
        raise ValueError(f"{path} has no 'full' line")
    return psi["full"]["avg10"]


def cgroup_pressure_path(container_id: str, root: str) -> str | None:
    for pattern in CGROUP_PATTERNS:
        hits = glob.glob(pattern.format(root=root, id=container_id))
        if hits:
            return hits[0]
    return None


@dataclass
class Guard:
    """The decision, apart from any I/O: feed it (time, full avg10) samples."""

    threshold: float  # percent
    hold: float  # seconds above the threshold before acting
    above_since: float | None = None
    last: float | None = None

    def sample(self, now: float, value: float) -> bool:
        """True when the pressure has stayed above the threshold for `hold` seconds."""
        self.last = value
        if value <= self.threshold:
            self.above_since = None
            return False
        if self.above_since is None:
            self.above_since = now
        return now - self.above_since >= self.hold

    def above_for(self, now: float) -> float:
        return 0.0 if self.above_since is None else now - self.above_since

    def reset(self) -> None:
        self.above_since = None


def reason(name: str, value: float, g: Guard, seconds: float, source: str, grace: int) -> str:
    return (f"memory pressure: PSI full avg10 {value:.1f}% stayed above {g.threshold:g}% for {seconds:.0f} s "
            f"(GUARD_PSI_FULL={g.threshold:g}, GUARD_HOLD={g.hold:g}; {source}); stopped {name} gracefully "
            f"(docker stop, {grace} s grace) before the kernel locks the box")


# -- the Engine API over its socket ---------------------------------------------------------
class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


class Engine:
    def __init__(self, host: str = "unix:///var/run/docker.sock"):
        if not host.startswith("unix://"):
            raise ValueError(f"the guard speaks to the Docker Engine over its unix socket, not {host!r}")
        self.path = host[len("unix://"):]

    def call(self, method: str, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        conn = _Unix(self.path, timeout)
        try:
            conn.request(method, API + path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def server(self, name: str) -> dict | None:
        """The server container of NAME (inspect JSON), never a guard or router beside it."""
        filters = quote(json.dumps({"label": [f"{LABEL}={name}"]}))
        status, body = self.call("GET", f"/containers/json?all=1&filters={filters}")
        if status != 200:
            raise OSError(f"Engine API: list containers answered {status}: {body[:200]!r}")
        rows = [c for c in json.loads(body) if c.get("Labels", {}).get("org.flash.node", "0") == "0"]
        if not rows:
            return None
        status, body = self.call("GET", f"/containers/{rows[0]['Id']}/json")
        return json.loads(body) if status == 200 else None

    def stop(self, container_id: str, grace: int) -> int:
        status, body = self.call("POST", f"/containers/{container_id}/stop?t={int(grace)}", timeout=grace + 60)
        if status not in (204, 304):
            raise OSError(f"Engine API: stop answered {status}: {body[:200]!r}")
        return status


# -- metrics --------------------------------------------------------------------------------
@dataclass
class Snapshot:
    name: str
    source: str
    threshold: float
    hold: float
    value: float | None = None
    above_for: float = 0.0
    armed: bool = False  # the server runs and the guard watches it
    stops: int = 0
    last_stop: float | None = None
    last_reason: str = ""
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def exposition(self) -> str:
        def esc(v: str) -> str:
            return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

        with self.lock:
            lab = f'name="{esc(self.name)}",source="{esc(self.source)}"'
            lines = [
                "# HELP flash_guard_psi_full_avg10 PSI full avg10 the guard last read (percent).",
                "# TYPE flash_guard_psi_full_avg10 gauge",
                *([f"flash_guard_psi_full_avg10{{{lab}}} {self.value}"] if self.value is not None else []),
                "# HELP flash_guard_threshold_percent Pressure above which the hold time starts (GUARD_PSI_FULL).",
                "# TYPE flash_guard_threshold_percent gauge",
                f"flash_guard_threshold_percent{{{lab}}} {self.threshold}",
                "# HELP flash_guard_hold_seconds Seconds above the threshold before the server is stopped (GUARD_HOLD).",
                "# TYPE flash_guard_hold_seconds gauge",
                f"flash_guard_hold_seconds{{{lab}}} {self.hold}",
                "# HELP flash_guard_above_seconds How long the pressure has been above the threshold now.",
                "# TYPE flash_guard_above_seconds gauge",
                f"flash_guard_above_seconds{{{lab}}} {self.above_for:.1f}",
                "# HELP flash_guard_armed 1 while the server runs and the guard watches it.",
                "# TYPE flash_guard_armed gauge",
                f"flash_guard_armed{{{lab}}} {int(self.armed)}",
                "# HELP flash_guard_stops_total Servers this guard stopped for memory pressure.",
                "# TYPE flash_guard_stops_total counter",
                f"flash_guard_stops_total{{{lab}}} {self.stops}",
            ]
            if self.last_stop is not None:
                lines += ["# HELP flash_guard_last_stop_timestamp_seconds When the guard last stopped the server, "
                          "with why (reason label).",
                          "# TYPE flash_guard_last_stop_timestamp_seconds gauge",
                          f'flash_guard_last_stop_timestamp_seconds{{{lab},reason="{esc(self.last_reason)}"}} '
                          f"{self.last_stop:.3f}"]
        return "\n".join(lines) + "\n"


def serve_metrics(snap: Snapshot, addr: str) -> ThreadingHTTPServer:
    host, _, port = addr.rpartition(":")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = snap.exposition().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every 10 s must not flood the log
            pass

    srv = ThreadingHTTPServer((host.strip("[]") or "127.0.0.1", int(port)), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def say(text: str) -> None:
    print(f"flash-guard: {text}", flush=True)


def event(kind: str, **fields) -> None:
    print(f"{EVENT} " + json.dumps({"event": kind, "at": round(time.time(), 3), **fields}, sort_keys=True), flush=True)


def run(args: argparse.Namespace, engine: Engine, clock=time.monotonic, sleep=time.sleep) -> int:
    g = Guard(args.threshold, args.hold)
    snap = Snapshot(args.name, args.source, args.threshold, args.hold)
    if args.metrics:
        try:
            serve_metrics(snap, args.metrics)
        except (OSError, ValueError) as exc:  # a second server's guard on the same port: guard anyway
            say(f"no /metrics on {args.metrics} ({exc}); watching without them (set GUARD_PORT per server)")
    event("watching", name=args.name, source=args.source, threshold=args.threshold, hold=args.hold,
          interval=args.interval, grace=args.grace)
    say(f"watching {args.name}: stop it when PSI full avg10 ({args.source}) stays above {args.threshold:g}% "
        f"for {args.hold:g} s")
    armed_id = ""
    complained = ""
    while True:
        if args.source == "host":  # the box's pressure is worth exporting with no server at all
            try:
                v = full_avg10(args.psi)
                with snap.lock:
                    snap.value = v
            except (OSError, ValueError):
                pass
        try:
            c = engine.server(args.name)
            running = c is not None and c.get("State", {}).get("Status") == "running"
            if not running:
                if armed_id:
                    say(f"{args.name} is no longer running; waiting for it to start again")
                armed_id = ""
                g.reset()
            else:
                if c["Id"] != armed_id:
                    armed_id = c["Id"]
                    g.reset()
                    say(f"armed on {c['Name'].lstrip('/')} ({armed_id[:12]})")
                    event("armed", name=args.name, container=armed_id)
                if args.source == "host":
                    path = args.psi
                else:
                    path = cgroup_pressure_path(armed_id, args.cgroup_root) or ""
                    if not path:
                        raise FileNotFoundError(f"no memory.pressure for container {armed_id[:12]} under "
                                                f"{args.cgroup_root} (cgroup v2 with PSI needed)")
                value = full_avg10(path)
                now = clock()
                fire = g.sample(now, value)
                with snap.lock:
                    snap.value, snap.above_for, snap.armed, snap.error = value, g.above_for(now), True, ""
                if fire:
                    why = reason(args.name, value, g, g.above_for(now), f"{args.source}: {path}", args.grace)
                    say("STOPPING " + why)
                    event("stopping", name=args.name, container=armed_id, psi_full_avg10=value,
                          threshold=args.threshold, hold=args.hold, above_s=round(g.above_for(now), 1),
                          source=args.source, path=path, reason=why)
                    engine.stop(armed_id, args.grace)
                    with snap.lock:
                        snap.stops += 1
                        snap.last_stop, snap.last_reason, snap.armed = time.time(), why, False
                    event("stopped", name=args.name, container=armed_id, reason=why)
                    say(f"stopped {args.name}; `flash start` resumes it once memory is free")
                    armed_id = ""
                    g.reset()
            with snap.lock:
                snap.armed = bool(armed_id)
            complained = ""
        except (OSError, ValueError) as exc:  # a transient engine or /proc problem: say it once, retry
            text = f"{type(exc).__name__}: {exc}"
            if text != complained:
                say(f"cannot watch {args.name} now: {text}")
                complained = text
            with snap.lock:
                snap.error = text
        if args.once:
            return 0
        sleep(args.interval)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m flash_common.memguard", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="the server's NAME (label org.flash.name)")
    p.add_argument("--source", choices=("host", "container"), default="host")
    p.add_argument("--threshold", type=float, default=25.0, help="PSI full avg10 percent (default 25)")
    p.add_argument("--hold", type=float, default=20.0, help="seconds above the threshold before stopping")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between reads")
    p.add_argument("--grace", type=int, default=30, help="docker stop's grace period (s) before SIGKILL")
    p.add_argument("--psi", default=HOST_PSI, help="the host pressure file (source host)")
    p.add_argument("--cgroup-root", default="/sys/fs/cgroup", help="the host's cgroup tree (source container)")
    p.add_argument("--docker", default=os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"))
    p.add_argument("--metrics", default="", metavar="HOST:PORT", help="serve /metrics here (empty: off)")
    p.add_argument("--once", action="store_true", help="one read and decision, then exit (tests)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not 0 < args.threshold < 100:
        print(f"flash-guard: --threshold {args.threshold} is not a percentage in (0, 100)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # docker stop on the guard: exit at once
    try:
        return run(args, Engine(args.docker))
    except ValueError as exc:
        print(f"flash-guard: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
