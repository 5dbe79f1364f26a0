"""`flash eval` on lm-evaluation-harness against the stand-in server (real HTTP, real lm-eval,
its local-chat-completions model): a tiny offline task whose answers the stand-in's greedy replies
decide (Paris and 4 right, Madrid and Basho wrong: exact match 0.5), two labels side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "fakes" / "data" / "eval_tiny" / "tiny.jsonl"
sys.path.insert(0, str(ROOT / "tests" / "standin"))
from harness import StandIn  # noqa: E402

TASK = """task: flash_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  do_sample: false
  temperature: 0
  max_gen_toks: 32
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "([A-Za-z0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def flash(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flash_cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=240)


@pytest.mark.timeout(300)
def test_eval_against_the_standin_and_the_side_by_side_table(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "flash_tiny.yaml").write_text(TASK.format(data=DATA))
    out = tmp_path / "results"
    env = {**os.environ, "HOME": str(tmp_path), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    common = ["--tasks", "flash_tiny", "--include-path", str(tasks), "--out", str(out)]
    with StandIn("--api-key", "sekret") as s:
        # the key reaches the server in lm-eval's header (a wrong or absent key is a 401 there)
        env["XDG_STATE_HOME"] = str(tmp_path / "state")
        keyfile = tmp_path / "state" / "flash" / "api-key.qwen38-flash"  # flash serve's key file for NAME
        keyfile.parent.mkdir(parents=True)
        keyfile.write_text("sekret\n")
        a = flash("eval", "--url", s.url + "/v1", "--label", "all4", "--limit", "0", *common, env=env)
        b = flash("eval", "--url", s.url, "--label", "first2", "--limit", "2", *common, env=env)
        served = [ln for ln in s.lines if "chat/completions" in ln]
    assert a.returncode == 0, a.stderr[-3000:]
    assert b.returncode == 0, b.stderr[-3000:]
    rec = json.loads((out / "eval-all4.json").read_text())
    assert rec["tasks"]["flash_tiny"]["exact_match,first_word"]["value"] == 0.5
    assert rec["samples"]["flash_tiny"] == 4 and rec["lm_eval"] == "0.4.13" and rec["plan"]["auth"] is True
    assert "sekret" not in json.dumps(rec)
    assert json.loads((out / "eval-first2.json").read_text())["tasks"]["flash_tiny"]["exact_match,first_word"]["value"] == 1.0
    table = flash("eval", "--compare", "all4", "first2", "--out", str(out), env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["task", "metric", "all4", "first2", "first2", "-", "all4"]
    row = next(ln for ln in lines if ln.startswith("flash_tiny"))
    assert "0.5000" in row and "1.0000" in row and row.rstrip().endswith("+0.5000")


def test_eval_refuses_bad_input_and_plans_without_running(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    res = flash("eval", "--url", "http://127.0.0.1:9", "--label", "a/b", env=env)
    assert res.returncode == 2 and "--label 'a/b' is not valid" in res.stderr
    res = flash("eval", "--compare", "nope", "other", "--out", str(tmp_path), env=env)
    assert res.returncode == 2 and "eval-nope.json" in res.stderr
    res = flash("eval", "--url", "http://127.0.0.1:9", "--dry-run", env=env)
    plan = json.loads(res.stdout)
    assert plan["tasks"] == ["gsm8k", "ifeval"] and plan["limit"] == 150 and plan["url"] == "http://127.0.0.1:9"
