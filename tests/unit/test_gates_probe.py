"""`flash probe` and `--diff` against the stand-in; the shell wrappers run the same Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flash_cli.__main__ import main
from flash_cli.gates import probe

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "standin"))
from harness import StandIn  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_probe_twice_is_identical_and_a_nondeterministic_server_differs(capsys, tmp_path):
    with StandIn() as s:
        assert main(["probe", "a", "--url", s.url, "--max-tokens", "40"]) == 0
        assert main(["probe", "b", "--url", s.url, "--max-tokens", "40"]) == 0
    with StandIn(faults="nondeterministic") as s:
        assert main(["probe", "c", "--url", s.url, "--max-tokens", "40"]) == 0
    capsys.readouterr()
    doc = json.loads((probe.probe_dir() / "a.json").read_text())
    assert [r["prompt"] for r in doc["results"]] == list(probe.P.PROBE_PROMPTS)
    assert all(r["tokens"] > 0 and r["first_logprobs"] for r in doc["results"])
    assert main(["probe", "--diff", "a", "b"]) == 0
    assert "IDENTICAL" in capsys.readouterr().out
    assert main(["probe", "--diff", "a", "c"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and ("DIFFERS at char" in out or "logprobs differ" in out)


def test_diff_names_the_first_differing_byte(tmp_path):
    base = {"label": "x", "prompts_version": 1, "max_tokens": 10,
            "results": [{"prompt": "p1", "text": "same", "tokens": 1, "first_logprobs": {"a": -0.1}},
                        {"prompt": "p2", "text": "Hello world", "tokens": 2, "first_logprobs": {"a": -0.1}}]}
    other = json.loads(json.dumps(base))
    other["label"] = "y"
    other["results"][1]["text"] = "Hello wOrld"
    same, lines = probe.diff(base, other)
    assert not same and "DIFFERS at char 7" in lines[1]
    other["results"][1]["text"] = "Hello world"
    other["results"][0]["first_logprobs"] = {"a": -0.1002}
    same, lines = probe.diff(base, other)
    assert not same and "differ by 0.0002" in lines[0]
    same, _ = probe.diff(base, other, logprob_tol=1e-3)
    assert same


def test_diff_refuses_missing_or_bad_inputs(tmp_path, capsys):
    assert main(["probe", "--diff", "nope", "nada"]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["probe", "--diff", str(bad), str(bad)]) == 2
    assert "not a probe file" in capsys.readouterr().err
    assert main(["probe", "bad label!", "--url", "http://127.0.0.1:9"]) == 2


def test_wrapper_scripts_run_the_same_python(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "STANDIN_FAULTS": ""}
    with StandIn() as s:
        hostport = s.url.removeprefix("http://")
        smoke = subprocess.run([str(ROOT / "scripts" / "smoke-test.sh"), hostport, "--json", "--only", "coherence"],
                               capture_output=True, text=True, env=env, timeout=60)
        assert smoke.returncode == 0, smoke.stderr
        assert json.loads(smoke.stdout)["ok"] is True
        gp = subprocess.run([str(ROOT / "scripts" / "greedy-probe.sh"), "w1", hostport, "--max-tokens", "8"],
                            capture_output=True, text=True, env=env, timeout=60)
        assert gp.returncode == 0, gp.stderr
    with StandIn(faults="no_tool_calls") as s:
        smoke = subprocess.run([str(ROOT / "scripts" / "smoke-test.sh"), s.url, "--only", "tool_call"],
                               capture_output=True, text=True, env=env, timeout=60)
    assert smoke.returncode == 1 and "tool_call" in smoke.stdout
    assert (tmp_path / ".local" / "state" / "flash" / "probes" / "w1.json").is_file()
