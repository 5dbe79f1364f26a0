"""vllm tier: what prometheus_client's multiprocess mode does to each release's /metrics, measured
with the release's own PrometheusStatLogger and our PLE counters (tests/vllm/metrics_multiproc_diff.py).
The gates, rules and dashboard depend on the outcome (docs/OBSERVABILITY.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from flash_vllm.ple.stats import COUNTERS

from release_envs import RELEASES, ensure

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # the diff scripts run with the release's python


@pytest.mark.parametrize("release", RELEASES)
def test_multiprocess_mode_keeps_every_vllm_family_and_shows_the_ple_counters(release, tmp_path):
    rt = ensure(release)
    out = tmp_path / "diff.json"
    proc = subprocess.run([rt["python"], str(HERE / "metrics_multiproc_diff.py"), "--json", str(out)],
                          env=rt["env"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["vllm"].startswith(release.split("+")[0])
    ple = {name for name, _ in COUNTERS.values()}
    assert ple <= set(d["ple_visible_multi"])
    # what multiprocess mode costs: *_created plus the default process/platform collectors, nothing else
    assert all(f.endswith("_created") or f.startswith(("process_", "python_")) for f in d["lost_in_multi"]), d["lost_in_multi"]
    assert not d["label_sets_changed"]
    core = {"vllm:num_requests_running", "vllm:prefix_cache_hits", "vllm:generation_tokens", "vllm:time_to_first_token_seconds"}
    assert core <= set(d["multi"])
