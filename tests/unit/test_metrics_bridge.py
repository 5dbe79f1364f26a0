"""The PLE metrics bridge (flash_vllm/metrics_bridge.py): engine processes publish, the API
process's single-process /metrics carries the summed vllm:ple_mmap_* families and loses nothing.

Real processes throughout: an "API server" script (its own interpreter, prometheus_client's default
REGISTRY, install() as the plugin calls it) starts "engine" processes with multiprocessing (spawn,
like vLLM's EngineCore) that create PLEStats exactly as the PLE patch does, and scrapes
generate_latest(REGISTRY), parsed with prometheus_client's parser.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flash_vllm import metrics_bridge as mb
from flash_vllm.ple.stats import COUNTERS, START_GAUGE

ROOT = Path(__file__).resolve().parents[2]
PLE = {name for name, _ in COUNTERS.values()} | {START_GAUGE[0]}
CREATED = {name + "_created" for name, _ in COUNTERS.values()}

API = textwrap.dedent(r'''
    import json, multiprocessing as mp, os, sys, time
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def engine(record, hold, ready):
        # what the PLE patch does in the EngineCore: one PLEStats, lookups record into it
        from flash_vllm.ple.stats import PLEStats
        from flash_vllm import metrics_bridge; metrics_bridge.wire()  # what register() does
        s = PLEStats(stats_sec=0, prometheus=True)
        for _ in range(record.get("ops", 0)):
            s.record(ops=1, op_s=0.004, gpu_wait_s=0.001, dedup_s=0.0002, gather_s=0.002, stage_s=0.0005,
                     rows=16, bytes=16 * 160)
        ready.set()
        hold.wait(30)

    def scrape():
        out = {}
        for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
            out[fam.name] = {"type": fam.type, "doc": fam.documentation,
                             "samples": [[s.name, s.labels, s.value] for s in fam.samples]}
        return out

    def wait_value(name, want, timeout=30):
        t0 = time.time()
        while time.time() - t0 < timeout:
            f = scrape().get(name)
            if f and any(s[0] == name + "_total" and s[2] == want for s in f["samples"]):
                return time.time() - t0
            time.sleep(0.02)
        raise SystemExit(f"{name} never reached {want}: {scrape().get(name)}")

    if __name__ == "__main__":
        plan = json.loads(sys.argv[1])
        ctx = mp.get_context("spawn")
        result = {"before": scrape()}
        from flash_vllm import metrics_bridge
        result["install"] = metrics_bridge.install()
        result["empty"] = scrape()
        result["steps"] = []
        for step in plan:
            hold, ready = ctx.Event(), ctx.Event()
            procs = [ctx.Process(target=engine, args=(r, hold, ready)) for r in step["engines"]]
            for p in procs:
                p.start()
                ready.wait(60); ready.clear()
            if step.get("wait"):
                result["steps"].append({"lag_s": wait_value(*step["wait"])})
            live = scrape()
            hold.set()
            for p in procs:
                p.join(60)
            result["steps"].append({"live": live, "pids": [p.pid for p in procs], "after_exit": scrape(),
                                    "exitcodes": [p.exitcode for p in procs]})
        d = os.environ["FLASH_METRICS_DIR"]
        result["dir"] = sorted(os.listdir(d)) if os.path.isdir(d) else None
        print(json.dumps(result))
''')


def run_api(tmp_path, plan, **env_extra):
    script = tmp_path / "api_server.py"
    script.write_text(API)
    mdir = tmp_path / "records"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROMETHEUS_MULTIPROC", "FLASH_METRICS"))}
    env.update({"PYTHONPATH": str(ROOT / "src"), "VLLM_PLE_MMAP": "1", "FLASH_METRICS_DIR": str(mdir),
                "FLASH_METRICS_INTERVAL_MS": "50", **env_extra})
    proc = subprocess.run([sys.executable, str(script), json.dumps(plan)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def value(fams, name, suffix="_total"):
    s = [x for x in fams[name]["samples"] if x[0] == name + suffix]
    assert len(s) == 1, fams[name]
    return s[0][2]


def test_two_engines_sum_restart_and_dead_pids_keep_counting(tmp_path):
    plan = [{"engines": [{"ops": 3}, {"ops": 5}], "wait": ["vllm:ple_mmap_lookup_ops", 8]},
            {"engines": [{"ops": 2}], "wait": ["vllm:ple_mmap_lookup_ops", 10]}]
    r, err = run_api(tmp_path, plan)
    assert r["install"].startswith("metrics bridge on"), r["install"]
    assert not ((PLE | CREATED) & set(r["empty"])), "no engine yet: no PLE families (all or none)"
    first, second = r["steps"][1], r["steps"][3]
    assert first["exitcodes"] == [0, 0] and second["exitcodes"] == [0]
    live, dead = first["live"], first["after_exit"]
    # two live engine processes, summed
    assert value(live, "vllm:ple_mmap_lookup_ops") == 8
    assert value(live, "vllm:ple_mmap_rows") == 8 * 16 and value(live, "vllm:ple_mmap_bytes") == 8 * 2560
    assert value(live, "vllm:ple_mmap_op_seconds") == pytest.approx(8 * 0.004)
    assert value(live, "vllm:ple_mmap_gather_seconds") == pytest.approx(8 * 0.002)
    # both engines gone: the counters do not go down
    assert value(dead, "vllm:ple_mmap_lookup_ops") == 8
    # a restarted engine (new pid) adds to them; *_created stays the first engine's (no reset),
    # the start-time gauge moves to the newest engine (the restart marker)
    after = second["after_exit"]
    assert value(after, "vllm:ple_mmap_lookup_ops") == 10
    assert value(after, "vllm:ple_mmap_stage_seconds") == pytest.approx(10 * 0.0005)
    assert value(after, "vllm:ple_mmap_lookup_ops_created", "") == value(dead, "vllm:ple_mmap_lookup_ops_created", "")
    g0 = dead[START_GAUGE[0]]["samples"][0][2]
    g1 = after[START_GAUGE[0]]["samples"][0][2]
    assert g1 > g0 >= value(dead, "vllm:ple_mmap_lookup_ops_created", "")
    # one record per engine process, no tmp leftovers
    assert len([n for n in r["dir"] if n.endswith(".json")]) == 3 and not [n for n in r["dir"] if n.endswith(".tmp")]
    # published within a few intervals (50 ms here), not per lookup
    assert r["steps"][0]["lag_s"] < 10


def test_nothing_else_lost_and_exact_families(tmp_path):
    r, _ = run_api(tmp_path, [{"engines": [{"ops": 1}]}])
    before, after = r["before"], r["steps"][0]["live"]
    # every family of the registry without the bridge is still there (process_*, python_*, *_created)
    assert set(before) <= set(after), set(before) - set(after)
    assert any(n.startswith("process_") for n in before) and any(n.startswith("python_") for n in before)
    assert set(after) - set(before) == PLE | CREATED
    # exactly what the native counters expose: counter families with _total, *_created gauges
    # (text format 0.0.4), unlabelled
    for key, (name, doc) in COUNTERS.items():
        f, c = after[name], after[name + "_created"]
        assert f["type"] == "counter" and f["doc"] == doc and c["type"] == "gauge"
        assert [s[0] for s in f["samples"]] == [name + "_total"] and [s[0] for s in c["samples"]] == [name + "_created"]
        assert all(s[1] == {} for s in f["samples"] + c["samples"])
    g = after[START_GAUGE[0]]
    assert g["type"] == "gauge" and g["doc"] == START_GAUGE[1] and len(g["samples"]) == 1
    assert g["samples"][0][1] == {} and g["samples"][0][2] > 1.7e9


def test_same_families_as_native_counters():
    """The bridge's exposition of given totals == native prometheus_client counters with them."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families as parse

    from flash_vllm.ple.stats import PLEStats

    native = CollectorRegistry()
    st = PLEStats(prometheus=True, registry=native)
    st.record(ops=2, op_s=0.5, rows=96, bytes=15360)
    agg = {"values": {k: float(st.snapshot()["total"][k]) for k in COUNTERS}, "created": 1.8e9, "engine_start": 1.8e9}
    bridged = CollectorRegistry()
    bridged.register(type("C", (), {"collect": lambda self: list(mb.PLEBridgeCollector._families(agg))})())
    shape = lambda reg: {(f.name, f.type, f.documentation, tuple(sorted((s.name, tuple(s.labels.items()),
                         s.value if not s.name.endswith(("_created", "_seconds")) else 0) for s in f.samples)))
                         for f in parse(generate_latest(reg).decode())}
    assert shape(native) == shape(bridged)


def test_multiprocess_mode_is_left_to_prometheus_client(tmp_path):
    mp_dir = tmp_path / "prom-mp"
    mp_dir.mkdir()
    r, _ = run_api(tmp_path, [{"engines": [{"ops": 4}]}], PROMETHEUS_MULTIPROC_DIR=str(mp_dir))
    assert r["install"] == "metrics bridge multiprocess"
    assert r["dir"] is None  # the bridge never even made its directory
    # the engine's native counters went to prometheus_client's mmap files; aggregated once
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from prometheus_client.parser import text_string_to_metric_families as parse

    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(mp_dir))
    fams = {f.name: f for f in parse(generate_latest(reg).decode())}
    s = [x for x in fams["vllm:ple_mmap_lookup_ops"].samples if x.name.endswith("_total")]
    assert [x.value for x in s] == [4.0]


def _record(d: Path, ns, pid, start, lineage, root, ops, created=1.8e9):
    doc = {"format": 1, "ns": ns, "pid": pid, "start": start, "lineage": lineage, "root": root, "created": created,
           "engine_start": created, "seq": 1, "time": created, "values": dict.fromkeys(COUNTERS, 0) | {"ops": ops}}
    (d / f"ple-{ns}-{pid}-{start}.json").write_text(json.dumps(doc))


def test_collector_scope_garbage_and_broken_records(tmp_path):
    """Only this process's descendants count; records of finished servers are collected; a
    broken record or an unreadable directory never fails the scrape."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families as parse

    ns, pid, start = mb.identity()
    _record(tmp_path, ns, 999_999_1, 5, [[pid, start]], f"{pid}:{start}", 7)          # our dead child
    _record(tmp_path, ns, 999_999_2, 5, [[424242, 1]], "424242:1", 100)              # finished server
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lst = mb._stat(live.pid)
        _record(tmp_path, ns, live.pid, lst[1], [[1, 0]], f"{live.pid}:{lst[1]}", 1000)  # a live other server
        _record(tmp_path, ns + 1, pid, start, [], "1:1", 10_000)                       # other pid namespace
        _record(tmp_path, ns + 2, 77, 7, [], "1:1", 10_000)                            # ... untouched for 2 days
        os.utime(tmp_path / f"ple-{ns + 2}-77-7.json", (time.time() - 2 * 86400,) * 2)
        (tmp_path / f"ple-{ns}-999999-7.json").write_text('{"format": 1, "ns"')        # torn/foreign bytes
        (tmp_path / f".ple-{ns}-999999-7.1.tmp").write_text("{")
        reg = CollectorRegistry()
        coll = mb.PLEBridgeCollector(tmp_path, env={})
        reg.register(coll)
        fams = {f.name: f for f in parse(generate_latest(reg).decode())}
        ops = [s.value for s in fams["vllm:ple_mmap_lookup_ops"].samples if s.name.endswith("_total")]
        assert ops == [7.0]
        left = sorted(os.listdir(tmp_path))
        assert f"ple-{ns}-9999992-5.json" not in left                      # finished server: removed
        assert f"ple-{ns}-9999991-5.json" in left                          # our dead child: kept (monotonic)
        assert f"ple-{ns}-{live.pid}-{lst[1]}.json" in left                # live other server: untouched
        assert f"ple-{ns + 1}-{pid}-{start}.json" in left                  # other namespace: untouched
        assert f"ple-{ns + 2}-77-7.json" not in left                       # ... unless stale for a day
    finally:
        live.kill()
        live.wait()
    # the directory disappears under the collector: the scrape still works, PLE families absent
    coll._dir = tmp_path / "gone"
    text = generate_latest(reg).decode()
    assert "ple_mmap" not in text
    coll._dir = None
    coll._env = {"FLASH_METRICS_DIR": str(tmp_path / "file")}
    (tmp_path / "file").write_text("x")
    assert "ple_mmap" not in generate_latest(reg).decode()


def test_unusable_directory_falls_back_and_never_breaks_a_lookup(tmp_path):
    (tmp_path / "not-a-dir").write_text("x")
    code = textwrap.dedent('''
        import logging, sys
        logging.basicConfig(level=logging.WARNING)
        from flash_vllm.ple.stats import PLEStats
        from flash_vllm import metrics_bridge; metrics_bridge.wire()  # what register() does
        s = PLEStats(prometheus=True)
        s.record(ops=1, rows=3)
        from prometheus_client import REGISTRY, generate_latest
        text = generate_latest(REGISTRY).decode()
        print(s._bridge is None, "vllm:ple_mmap_lookup_ops_total 1.0" in text)
    ''')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROMETHEUS_MULTIPROC", "FLASH_METRICS"))}
    env.update({"PYTHONPATH": str(ROOT / "src"), "FLASH_METRICS_DIR": str(tmp_path / "not-a-dir" / "sub")})
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True"]  # native counters instead, counting
    assert "PLE metrics bridge unavailable" in p.stderr


def test_install_gates(monkeypatch):
    assert mb.install({"VLLM_PLE_MMAP": "1", "PROMETHEUS_MULTIPROC_DIR": "/x"}) == "metrics bridge multiprocess"
    assert mb.install({"VLLM_PLE_MMAP": "1", "FLASH_METRICS_BRIDGE": "0"}) == "metrics bridge off"
    assert mb.install({"VLLM_PLE_MMAP": "0"}).startswith("metrics bridge idle")
    assert mb.install({"VLLM_PLE_MMAP": "1", "VLLM_PLE_MMAP_PROMETHEUS": "0"}).startswith("metrics bridge idle")
    assert mb.interval_s({"FLASH_METRICS_INTERVAL_MS": "250"}) == 0.25
    assert mb.interval_s({"FLASH_METRICS_INTERVAL_MS": "0"}) == 0.01


def test_publisher_writes_atomically_and_only_on_change(tmp_path):
    from flash_vllm.ple.stats import PLEStats

    st = PLEStats(prometheus=False)
    pub = mb.Publisher(tmp_path, interval=3600)
    pub.stats.append(st)
    assert pub.publish() and not pub.publish()          # unchanged: no write
    st.record(ops=2, rows=32)
    assert pub.publish()
    doc = json.loads(pub.path.read_text())
    assert doc["values"]["ops"] == 2 and doc["values"]["rows"] == 32 and doc["seq"] == 2
    assert [doc["ns"], doc["pid"], doc["start"]] == list(mb.identity())
    assert [n for n in os.listdir(tmp_path)] == [pub.path.name]
    # every read sees a whole record (rename), and the latest one
    for i in range(50):
        st.record(ops=1)
        assert pub.publish()
        assert json.loads(pub.path.read_text())["values"]["ops"] == 3 + i
    assert os.listdir(tmp_path) == [pub.path.name]


def test_standin_exposes_exactly_what_the_bridge_does():
    """The stand-in server (tests/standin) stays faithful: same PLE family names, types, help
    texts, sample names and label sets as the bridge's exposition, in single-process mode."""
    import requests
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families as parse

    sys.path.insert(0, str(ROOT / "tests" / "standin"))
    from harness import StandIn

    def shape(text):
        return {f.name: (f.type, f.documentation, sorted((s.name, tuple(sorted(s.labels))) for s in f.samples))
                for f in parse(text) if f.name.startswith("vllm:ple_mmap")}

    agg = {"values": dict.fromkeys(COUNTERS, 1.0), "created": 1.8e9, "engine_start": 1.8e9}
    reg = CollectorRegistry()
    reg.register(type("C", (), {"collect": lambda self: list(mb.PLEBridgeCollector._families(agg))})())
    with StandIn(env={"VLLM_PLE_MMAP": "1"}) as s:
        standin = shape(requests.get(s.url + "/metrics", timeout=5).text)
    assert standin == shape(generate_latest(reg).decode())
    assert len(standin) == 17  # 8 counters, their 8 *_created, the start-time gauge


def test_failed_first_write_falls_back_to_native_counters(tmp_path, monkeypatch):
    from flash_vllm.ple.stats import PLEStats

    pub = mb.Publisher(tmp_path, interval=3600)
    monkeypatch.setattr(mb.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        pub.attach(PLEStats(prometheus=False))
    assert pub.stats == [] and os.listdir(tmp_path) == []  # nothing attached, no torn tmp file left
