"""`flash status` compares the boot log with the prediction `flash serve` stored in a label."""

import json
import subprocess
import sys

import pytest

from flash_cli import kvline
from flash_cli.commands.status import plan_comparison
from flash_cli.plan import build, prediction, status_comparison
from flash_cli.plan.hardware import PRESETS
from flash_cli.settings import resolve
from flash_cli.spec import LABEL

LINE = "(EngineCore pid=7) INFO 09-14 kv_cache_utils.py:2033] GPU KV cache size: 650,000 tokens, Maximum concurrency"


def test_label_round_trip_and_comparison():
    label = kvline.prediction_label(700_000, 660_000, 740_000, "gb10")
    assert kvline.parse_prediction(label) == (700_000, 660_000, 740_000)
    text = kvline.compare(700_000, 660_000, 740_000, LINE)
    assert "measured 650,000 tokens, predicted 700,000 (+7.7%; outside" in text
    assert "inside" in kvline.compare(700_000, 600_000, 740_000, LINE)
    assert "no 'GPU KV cache size' line" in kvline.compare(1, 0, 2, "")


@pytest.mark.parametrize("bad", ["", "[]", "{}", '{"tokens": 1}', "not json", '{"error": "boom"}'])
def test_bad_label_is_refused(bad):
    with pytest.raises(ValueError):
        kvline.parse_prediction(bad)


def test_status_uses_the_stored_prediction_and_says_when_it_is_unusable():
    labels = {f"{LABEL}.kv-plan": kvline.prediction_label(700_000, 660_000, 740_000, "gb10"),
              f"{LABEL}.recipe": "{not json"}  # would fail if status re-planned
    assert "predicted 700,000" in plan_comparison(labels, LINE)
    err = {f"{LABEL}.kv-plan": json.dumps({"error": "snapshot unreadable"})}
    assert "unavailable" in plan_comparison(err, LINE) and "snapshot unreadable" in plan_comparison(err, LINE)


def test_containers_without_the_label_are_re_planned():
    s = resolve(None, None, {"MODE": "hybrid"})
    labels = {f"{LABEL}.recipe": json.dumps(s.overrides())}
    text = plan_comparison(labels, LINE)
    assert text.startswith("KV pool: measured 650,000 tokens, predicted")
    assert plan_comparison({}, LINE) is None


def test_prediction_is_the_plan():
    s = resolve(None, None, {"MODE": "hybrid", "CTX": "500000", "YARN": "1"})
    hw = PRESETS["gb10"]
    plan = build(s, hw)
    assert prediction(s, hw) == (plan["kv_cache_tokens"], *plan["kv_cache_tokens_range"], "gb10",
                                 plan["host"]["page_cache_for_ple_gib"])
    assert status_comparison(s, LINE, hw) == kvline.compare(*prediction(s, hw)[:3], LINE)


def test_status_path_does_not_import_the_planner():
    code = ("import sys; from flash_cli.commands.status import plan_comparison; from flash_cli import kvline;"
            f"plan_comparison({{'{LABEL}.kv-plan': kvline.prediction_label(1, 0, 2, 'x')}}, '');"
            "print('flash_cli.plan' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
