"""vllm tier: the metrics bridge on a real release's metrics setup (tests/vllm/metrics_bridge_diff.py):
vLLM's own plugin loader runs flash_vllm.register(), PrometheusStatLogger starts (and unregisters
"vllm:" collectors), an EngineCore-like spawned child counts PLE lookups, and the single-process
/metrics gains exactly the PLE families and loses nothing (docs/OBSERVABILITY.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from flash_vllm.ple.stats import COUNTERS, START_GAUGE

from release_envs import RELEASES, ensure

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # the diff scripts run with the release's python


# oldest and newest: what differs between releases here (plugin loader, unregister_vllm_metrics,
# get_prometheus_registry) is shared by the releases between them
@pytest.mark.parametrize("release", [RELEASES[0], RELEASES[-1]])
def test_bridge_adds_the_ple_families_and_loses_nothing(release, tmp_path):
    rt = ensure(release)
    out = tmp_path / "diff.json"
    proc = subprocess.run([rt["python"], str(HERE / "metrics_bridge_diff.py"), "--json", str(out)],
                          env=rt["env"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["vllm"].startswith(release.split("+")[0])
    names = {n for n, _ in COUNTERS.values()}
    assert d["lost_with_bridge"] == [] and d["label_sets_changed"] == []
    assert set(d["gained_with_bridge"]) == names | {n + "_created" for n in names} | {START_GAUGE[0]}
    # counted once in every mode that shows them; stock single-process mode does not
    assert d["ple_ops"] == {"plain": None, "bridge": d["ops_recorded"], "multiproc": d["ops_recorded"]}
    assert d["bridge_records"] == {"plain": 0, "bridge": 1, "multiproc": 0}
    assert d["engine_exit"] == {"plain": 0, "bridge": 0, "multiproc": 0}
