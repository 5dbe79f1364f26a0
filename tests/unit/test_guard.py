"""The memory guard (issue 36): the start check's arithmetic, the watchdog's decision, the sidecar's
spec through docker-py's real argument translation, its metrics through Prometheus' parser, and the
watchdog loop against a real HTTP server on a real unix socket speaking the Engine API's shape."""

from __future__ import annotations

import json
import socketserver
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from flash_cli import guard
from flash_cli.errors import MemoryLow
from flash_cli.plan import build, hardware
from flash_cli.settings import resolve
from flash_common import memguard

GIB = 1024**3


def meminfo(avail_gib: float, free_gib: float = 1.0, cached_gib: float = 0.0) -> dict[str, int]:
    return {"MemTotal": int(119.68 * GIB), "MemFree": int(free_gib * GIB), "Cached": int(cached_gib * GIB),
            "MemAvailable": int(avail_gib * GIB)}


SPARK = replace(hardware.PRESETS["gb10"], detected=True)


def test_the_need_is_the_plans_claim_on_the_unified_pool():
    s = resolve()
    plan = build(s, SPARK, snapshot=None, live_checks=False)
    need = guard.planned_need(plan)
    host = plan["host"]
    assert need == int((host["vllm_claim_gib"] + host["vllm_pre_snapshot_gib"]) * GIB)
    # GPU_MEM=0.80 of 121.69 GiB plus vLLM's processes before its first snapshot
    assert 99 * GIB < need < 101 * GIB
    assert guard.planned_need(build(s, hardware.PRESETS["h200"], snapshot=None, live_checks=False)) is None


def test_available_memory_counts_reclaimable_page_cache_once():
    need = 100 * GIB
    # a box that just read the checkpoint: little MemFree, the rest is droppable page cache that the
    # kernel already counts in MemAvailable; adding Cached again would wrongly pass 60 + 60
    ok = guard.check_memory(need, meminfo(avail_gib=110, free_gib=2, cached_gib=108), 4 * GIB, "gb10")
    assert ok.ok and "MemAvailable 110.0 GiB" in ok.text and "104.0 GiB" in ok.text
    short = guard.check_memory(need, meminfo(avail_gib=60, free_gib=1, cached_gib=60), 4 * GIB, "gb10")
    assert not short.ok
    err = guard.memory_low(short)
    assert isinstance(err, MemoryLow) and err.exit_code == 12
    assert "MemAvailable 60.0 GiB" in str(err) and "the plan's 100.0 GiB" in str(err) and "44.0 GiB short" in str(err)
    assert "--wait-memory" in err.hint
    # the margin is part of the line: exactly need + margin passes, one byte less does not
    edge = meminfo(0)
    edge["MemAvailable"] = need + GIB
    assert guard.check_memory(need, edge, GIB, "gb10").ok
    edge["MemAvailable"] -= 1
    assert not guard.check_memory(need, edge, GIB, "gb10").ok


def test_no_claim_on_the_host_pool_skips_with_a_reason():
    c = guard.check_memory(None, meminfo(10), 4 * GIB, "h200")
    assert c.ok and "skipped" in c.text
    checker = guard.memory_checker(resolve(), hw=hardware.PRESETS["gb10"], read_meminfo=lambda: meminfo(1))
    assert checker().ok and "not detected here" in checker().text


def test_checker_on_a_detected_spark_refuses_with_the_numbers():
    checker = guard.memory_checker(resolve(overrides={"GUARD_MARGIN": "2G"}), hw=SPARK,
                                   read_meminfo=lambda: meminfo(50))
    c = checker()
    assert not c.ok and c.margin == 2 * GIB and c.need > 99 * GIB


def test_wait_for_memory_polls_until_it_frees_or_times_out():
    t = [0.0]
    values = iter([40, 60, 80, 120])
    check = lambda: guard.check_memory(100 * GIB, meminfo(next(values)), 4 * GIB, "gb10")
    seen = []
    got = guard.wait_for_memory(check, 600, interval=5, clock=lambda: t[0],
                                sleep=lambda d: t.__setitem__(0, t[0] + d), progress=lambda c, w: seen.append(w))
    assert got.ok and seen == [0, 5, 10]
    t[0] = 0.0
    with pytest.raises(MemoryLow, match="after waiting 12 s"):
        guard.wait_for_memory(lambda: guard.check_memory(100 * GIB, meminfo(50), 0, "gb10"), 12, interval=5,
                              clock=lambda: t[0], sleep=lambda d: t.__setitem__(0, t[0] + d))
    # timeout 0 (GUARD_WAIT's default) refuses at once, without sleeping
    with pytest.raises(MemoryLow):
        guard.wait_for_memory(lambda: guard.check_memory(100 * GIB, meminfo(50), 0, "gb10"), 0,
                              clock=lambda: 0.0, sleep=lambda d: pytest.fail("slept"))


def test_the_guard_fires_only_after_holding_above_the_threshold():
    g = memguard.Guard(threshold=25, hold=20)
    assert not g.sample(0, 30) and not g.sample(10, 80) and not g.sample(19.9, 26)
    assert g.sample(20, 26)
    g.reset()
    # a dip to the threshold (not above) restarts the clock
    assert not g.sample(0, 90) and not g.sample(15, 25) and not g.sample(30, 90) and not g.sample(49, 90)
    assert g.sample(50, 90)


def test_psi_files_and_cgroup_layouts(tmp_path):
    f = tmp_path / "memory.pressure"
    f.write_text("some avg10=61.50 avg60=20.00 avg300=5.00 total=123\nfull avg10=55.25 avg60=18.00 avg300=4.00 total=99\n")
    assert memguard.full_avg10(str(f)) == 55.25
    f.write_text("some avg10=1.00 avg60=0.00 avg300=0.00 total=1\n")
    with pytest.raises(ValueError, match="no 'full' line"):
        memguard.full_avg10(str(f))
    cid = "ab" * 32
    for rel in (f"unified/docker/{cid}", f"system.slice/docker-{cid}.scope", f"docker/{cid}"):
        root = tmp_path / rel.replace("/", "_")
        (root / rel).mkdir(parents=True)
        (root / rel / "memory.pressure").write_text("x")
        assert memguard.cgroup_pressure_path(cid, str(root)) == str(root / rel / "memory.pressure")
    assert memguard.cgroup_pressure_path("cd" * 32, str(tmp_path)) is None


def test_sidecar_spec_through_docker_pys_translation():
    from docker.api.container import ContainerConfig
    from docker.types import HostConfig

    from flash_cli.render import to_docker_run, to_kwargs

    s = resolve(overrides={"GUARD_SOURCE": "container", "GUARD_PSI_FULL": "30", "GUARD_HOLD": "15",
                           "GUARD_PORT": "19555"})
    spec = guard.guard_spec(s, "qwen38-flash", "flash-vllm:v0.33", "unless-stopped")
    assert spec.name == "qwen38-flash-guard" and spec.labels[guard.GUARD_LABEL] == "qwen38-flash"
    assert "org.flash.name" not in spec.labels  # status/stop/rm find the server by it: never the guard
    kw = to_kwargs(spec)
    hc = HostConfig(version="1.41", mounts=kw["mounts"], network_mode=kw["network_mode"], ipc_mode=kw["ipc_mode"],
                    shm_size=kw["shm_size"], restart_policy=kw["restart_policy"], log_config=kw["log_config"])
    mounts = {m["Target"]: m for m in hc["Mounts"]}
    assert mounts["/var/run/docker.sock"]["Source"] == "/var/run/docker.sock" and not mounts["/var/run/docker.sock"]["ReadOnly"]
    assert mounts[guard.CGROUP_TARGET]["Source"] == "/sys/fs/cgroup" and mounts[guard.CGROUP_TARGET]["ReadOnly"]
    assert "DeviceRequests" not in hc and hc["NetworkMode"] == "host"
    ContainerConfig("1.41", kw["image"], kw["command"], entrypoint=kw["entrypoint"], healthcheck=kw["healthcheck"],
                    labels=kw["labels"], environment=kw["environment"])
    argv = kw["entrypoint"] + kw["command"]
    assert argv[:3] == ["python3", "-m", "flash_common.memguard"]
    args = memguard.parser().parse_args(argv[3:])
    assert (args.name, args.source, args.threshold, args.hold, args.metrics) == \
        ("qwen38-flash", "container", 30.0, 15.0, "127.0.0.1:19555")
    assert "--no-healthcheck" in to_docker_run(spec)
    assert "--metrics" not in guard.guard_args(resolve(overrides={"GUARD_PORT": "0"}), "x")


def test_serve_dry_run_shows_the_check_and_the_sidecar(capsys):
    from flash_cli.__main__ import main

    assert main(["serve", "default", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "memory check skipped" in err and "memory guard sidecar: docker run -d --name qwen38-flash-guard" in err
    assert main(["serve", "default", "GUARD=0", "--dry-run"]) == 0
    assert "memory guard sidecar" not in capsys.readouterr().err


def test_metrics_parse_with_prometheus_client():
    from prometheus_client.parser import text_string_to_metric_families

    snap = memguard.Snapshot("n\"1", "host", 25, 20, value=31.5, above_for=4, armed=True, stops=2,
                             last_stop=1700000000.5, last_reason='PSI full 40% "high"\nline')
    fams = {f.name: f for f in text_string_to_metric_families(snap.exposition())}
    assert fams["flash_guard_psi_full_avg10"].samples[0].value == 31.5
    assert fams["flash_guard_stops"].samples[0].value == 2
    last = fams["flash_guard_last_stop_timestamp_seconds"].samples[0]
    assert last.labels == {"name": 'n"1', "source": "host", "reason": 'PSI full 40% "high"\nline'}


class _UnixHTTP(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture
def engine_api(tmp_path):
    """A real HTTP server on a unix socket answering the three Engine API calls the guard makes."""
    calls: list[tuple[str, str]] = []
    state = {"Status": "running"}
    cid = "f" * 64

    class H(BaseHTTPRequestHandler):
        def _send(self, code: int, body: object = None) -> None:
            raw = b"" if body is None else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):  # noqa: N802
            calls.append(("GET", self.path))
            if self.path.startswith("/v1.41/containers/json"):
                self._send(200, [{"Id": cid, "Labels": {"org.flash.name": "srv"}}])
            elif self.path == f"/v1.41/containers/{cid}/json":
                self._send(200, {"Id": cid, "Name": "/srv", "State": dict(state)})
            else:
                self._send(404, {"message": "no"})

        def do_POST(self):  # noqa: N802
            calls.append(("POST", self.path))
            state["Status"] = "exited"
            self._send(204)

        def log_message(self, *a):
            pass

    sock = str(tmp_path / "docker.sock")
    srv = _UnixHTTP(sock, H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"unix://{sock}", calls, cid
    srv.shutdown()
    srv.server_close()


def test_watch_loop_stops_through_the_engine_api_and_logs_why(engine_api, tmp_path, capsys):
    url, calls, cid = engine_api
    psi = tmp_path / "pressure"
    psi.write_text("some avg10=70.00 avg60=1 avg300=1 total=1\nfull avg10=65.00 avg60=1 avg300=1 total=1\n")
    args = memguard.parser().parse_args(["--name", "srv", "--psi", str(psi), "--threshold", "25", "--hold", "6",
                                         "--interval", "2", "--grace", "7", "--docker", url])
    t = [0.0]
    stops: list[int] = []

    def sleep(d):
        t[0] += d
        if ("POST", f"/v1.41/containers/{cid}/stop?t=7") in calls:
            stops.append(1)
            raise SystemExit  # the test's way out of the endless loop, after the server was stopped

    with pytest.raises(SystemExit):
        memguard.run(args, memguard.Engine(url), clock=lambda: t[0], sleep=sleep)
    out = capsys.readouterr().out
    posts = [c for c in calls if c[0] == "POST"]
    assert posts == [("POST", f"/v1.41/containers/{cid}/stop?t=7")]  # once, with the grace period
    assert "STOPPING memory pressure: PSI full avg10 65.0% stayed above 25% for 6 s" in out
    ev = guard.last_event(out.splitlines())
    assert ev["event"] == "stopped" and "65.0%" in ev["reason"]
    # the filter the guard lists with: the server's label only
    listing = next(p for m, p in calls if p.startswith("/v1.41/containers/json"))
    from urllib.parse import parse_qs, urlsplit

    assert json.loads(parse_qs(urlsplit(listing).query)["filters"][0]) == {"label": ["org.flash.name=srv"]}


def test_pressure_below_the_threshold_never_stops(engine_api, tmp_path):
    url, calls, _ = engine_api
    psi = tmp_path / "pressure"
    psi.write_text("some avg10=40.00 avg60=1 avg300=1 total=1\nfull avg10=24.90 avg60=1 avg300=1 total=1\n")
    args = memguard.parser().parse_args(["--name", "srv", "--psi", str(psi), "--threshold", "25", "--hold", "2",
                                         "--docker", url])
    t = [0.0]
    n = [0]

    def sleep(d):
        t[0] += d
        n[0] += 1
        if n[0] > 50:
            raise SystemExit

    with pytest.raises(SystemExit):
        memguard.run(args, memguard.Engine(url), clock=lambda: t[0], sleep=sleep)
    assert not [c for c in calls if c[0] == "POST"]
