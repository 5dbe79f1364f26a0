"""obs tier: the shipped observability files against the real thing.

promtool checks the config and rules and runs the series fixtures; then a real Prometheus
(Debian's package) scrapes the stand-in server (PLE counters and MTP on) and a real
node-exporter, and every recording rule and every dashboard query must return data.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from flash_cli import monitor

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "observability"
sys.path.insert(0, str(ROOT / "tests" / "standin"))
from harness import StandIn  # noqa: E402

from tools import gen_dashboard  # noqa: E402

pytestmark = [pytest.mark.obs, pytest.mark.timeout(240)]


def need(tool: str) -> str:
    path = shutil.which(tool)
    if not path:  # the tier hook installs these; absence here is a broken setup, not a skip
        pytest.fail(f"{tool} not found: tests/support/tier-obs.sh installs it (tests/run obs)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*argv: str, cwd: Path = OBS) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_check_config_and_rules():
    promtool = need("promtool")
    res = run(promtool, "check", "config", "prometheus.yml")
    assert res.returncode == 0, res.stdout + res.stderr
    rules = sorted(str(p.relative_to(OBS)) for p in (OBS / "rules").glob("*.yml"))
    res = run(promtool, "check", "rules", *rules)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 14 rules found" in res.stdout and "SUCCESS: 6 rules found" in res.stdout


def test_promtool_rule_unit_tests_with_series_fixtures():
    res = run(need("promtool"), "test", "rules", "tests/rules_test.yml")
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_promtool_test_catches_a_broken_rule(tmp_path):
    """The fixtures are not vacuous: a rule that divides by op time alone fails them."""
    shutil.copytree(OBS / "rules", tmp_path / "rules")
    shutil.copytree(OBS / "tests", tmp_path / "tests")
    rec = tmp_path / "rules" / "flash-recording.yml"
    text = rec.read_text()
    broken = text.replace("""          / (sum by (model_name) (rate(vllm:ple_mmap_op_seconds_total[5m]))
             - sum by (model_name) (rate(vllm:ple_mmap_gpu_wait_seconds_total[5m])))""",
                          """          / sum by (model_name) (rate(vllm:ple_mmap_op_seconds_total[5m]))""")
    assert broken != text
    rec.write_text(broken)
    res = run(need("promtool"), "test", "rules", "tests/rules_test.yml", cwd=tmp_path)
    assert res.returncode != 0 and "flash:ple_gather_share:rate5m" in res.stdout + res.stderr


def test_dashboard_is_generated_and_current():
    res = run(sys.executable, str(ROOT / "tools" / "gen_dashboard.py"), "--check", cwd=ROOT)
    assert res.returncode == 0, res.stderr


def recording_rules() -> list[str]:
    names = []
    for line in (OBS / "rules" / "flash-recording.yml").read_text().splitlines():
        if line.strip().startswith("- record:"):
            names.append(line.split(":", 1)[1].strip())
    return names


def test_real_prometheus_scrapes_the_standin_and_every_query_returns_data(tmp_path):
    prometheus, node_exporter = need("prometheus"), need("prometheus-node-exporter")
    prom_port, node_port = free_port(), free_port()
    with StandIn("--speculative-config", '{"method":"mtp","num_speculative_tokens":2}', "--max-num-seqs", "2",
                 env={"VLLM_PLE_MMAP": "1", "STANDIN_DECODE_TPS": "200"}) as server:
        # the config Prometheus runs is the one `flash monitor` renders from the shipped files
        files = monitor.config_files(f"127.0.0.1:{server.port}", f"127.0.0.1:{node_port}",
                                     f"127.0.0.1:{prom_port}", interval="1s")
        for rel, text in files.items():
            if rel.startswith("prometheus/"):
                path = tmp_path / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        node = subprocess.Popen([node_exporter, f"--web.listen-address=127.0.0.1:{node_port}",
                                 "--collector.disable-defaults", "--collector.meminfo", "--collector.vmstat",
                                 *monitor.NODE_EXPORTER_FLAGS],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus/prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        stop = threading.Event()

        def traffic() -> None:  # repeated prefixes, streams, more requests than seqs (a queue)
            i = 0
            while not stop.is_set():
                bodies = [{"prompt": "ledger entries " * 300 + str(i % 3), "max_tokens": 8, "temperature": 0},
                          {"prompt": f"question {i}", "max_tokens": 16, "temperature": 0, "stream": True}]
                ts = [threading.Thread(target=requests.post, args=(server.url + "/v1/completions",),
                                       kwargs={"json": b, "timeout": 30}) for b in bodies * 2]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                i += 1

        loader = threading.Thread(target=traffic, daemon=True)
        loader.start()
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        queries = recording_rules() + gen_dashboard.queries()
        assert len(queries) >= 30
        empty: list[str] = queries
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    empty = [q for q in queries
                             if not requests.get(f"{api}/query", params={"query": q}, timeout=5).json()["data"]["result"]]
                except requests.RequestException:
                    empty = queries
                if not empty:
                    break
                time.sleep(2)
            targets = requests.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
            rules = requests.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
        finally:
            stop.set()
            loader.join(30)
            prom.terminate()
            node.terminate()
            prom.wait(20)
            node.wait(20)
    assert not empty, f"queries without data: {empty}"
    assert {t["labels"]["job"]: t["health"] for t in targets} == {"vllm": "up", "node": "up", "prometheus": "up"}
    health = {r["name"]: r["health"] for g in rules for r in g["rules"]}
    assert len(health) == 20 and set(health.values()) == {"ok"}, health
