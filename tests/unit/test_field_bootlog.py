"""Boot-log readers (issue 16): the silent context fallback and boot stalls by phase."""

from __future__ import annotations

import pytest

from flash_cli import bootlog
from flash_cli.settings import resolve

# vLLM's own line shapes (vllm/config/model.py "Using max model len %s"; the stand-in prints the same)
LEN = "(APIServer pid=1) INFO 12-01 10:00:01 [model.py:2170] Using max model len {}"


def test_expected_context_follows_ctx_and_yarn():
    assert bootlog.expected_context(resolve(overrides={"CTX": "500000", "YARN": "1"})) == 500000
    assert bootlog.expected_context(resolve(overrides={"CTX": "131072", "YARN": "0"})) == 131072
    assert bootlog.expected_context(resolve(overrides={"CTX": "500000", "YARN": "0"})) == 262144


def test_context_verdict_from_the_boot_log():
    assert bootlog.context_verdict(500000, ["nothing yet"]) is None
    level, text = bootlog.context_verdict(500000, [LEN.format(500000), LEN.format(500000)])
    assert level == "ok" and "500,000" in text
    level, text = bootlog.context_verdict(500000, [LEN.format(262144)])
    assert level == "fail" and "262,144" in text and "500,000" in text and "YaRN override did not take" in text
    # the fallback as the field saw it: a second "Using max model len" line with the native length
    level, text = bootlog.context_verdict(500000, [LEN.format(500000), "x", LEN.format(262144)])
    assert level == "fail" and "500,000, 262,144" in text and "YaRN override did not take" in text
    # a draft config with its own (shorter) length only warns
    level, text = bootlog.context_verdict(131072, [LEN.format(131072), LEN.format(65536)])
    assert level == "warn" and "65,536" in text


@pytest.mark.parametrize("line, phase", [
    ("INFO [default_loader.py:291] Loading safetensors checkpoint shards:  40% Completed | 16/40", "weights"),
    ("INFO [gpu_model_runner.py:5089] Model loading took 71.2 GiB memory and 312.4 seconds", "compile"),
    ("INFO [monitor.py:40] Starting torch.compile", "compile"),
    ("INFO [monitor.py:62] torch.compile takes 95.31 s in total", "KV allocation"),
    ("INFO [kv_cache_utils.py:1147] GPU KV cache size: 1,234,567 tokens, Maximum concurrency ...", "KV allocation"),
    ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  12%", "graph capture"),
    ("INFO [gpu_model_runner.py:6517] Graph capturing finished in 21 secs, took 0.52 GiB", None),
    ("INFO:     Application startup complete.", None),
    ("INFO Using max model len 500000", None),
])
def test_phase_of_last_marker(line, phase):
    got = bootlog.phase_of(["INFO starting", line, "DEBUG unrelated chatter"])
    assert (got.name if got else None) == phase


def test_bootwatch_reports_a_silent_phase_once_with_its_remedy():
    w = bootlog.BootWatch(threshold_s=60)
    tail = ["Loading safetensors ... done", "INFO [kv_cache_utils.py] GPU KV cache size: 999 tokens"]
    assert w.feed(tail, 0) is None
    assert w.feed(tail, 59) is None  # not yet
    stall = w.feed(tail, 61)
    assert stall is not None and stall.phase.name == "KV allocation" and stall.silent_s == 61
    assert "expandable_segments:True" in stall.phase.remedy and "PYTORCH_ALLOC_CONF" in stall.phase.remedy
    assert "KV allocation" in stall.message() and "61 s" in stall.message()
    assert w.feed(tail, 200) is None  # said once per silent stretch
    assert w.current(200).silent_s == 200  # still known for the timeout message
    tail2 = tail + ["Capturing CUDA graphs: 3%"]
    assert w.feed(tail2, 201) is None  # new output resets the clock
    assert w.feed(tail2, 262).phase.name == "graph capture"


def test_bootwatch_ignores_unknown_phases_and_zero_threshold():
    w = bootlog.BootWatch(threshold_s=10)
    quiet = ["INFO:     Application startup complete."]
    w.feed(quiet, 0)
    assert w.feed(quiet, 1000) is None
    off = bootlog.BootWatch(threshold_s=0)
    tail = ["Starting torch.compile"]
    off.feed(tail, 0)
    assert off.feed(tail, 10_000) is None


def runspec(s):
    """The RunSpec serve would run for these settings: what preflight checks."""
    from flash_cli.spec import build

    return build(s, profile="t", snapshot="SNAP", hf_cache="/hf", state_dir="/state")


def test_remedies_suggest_settings_flash_itself_accepts():
    import re

    from flash_cli import preflight, spec

    found = 0
    for ph in bootlog.PHASES:
        for key, value in re.findall(r"(COMPILE_FLAGS|CONTAINER_ENV)='([^']*)'", ph.remedy):
            s = resolve(overrides={key: value})
            assert not preflight.recipe(runspec(s)), (ph.name, key, value)
            spec.extra_env(s["CONTAINER_ENV"])
            found += 1
    assert found >= 3


def test_verdict_from_a_containers_recipe_label():
    labels = {"org.flash.recipe": '{"CTX":"500000","MODE":"hybrid","YARN":"1"}'}
    assert bootlog.verdict_for_labels(labels, [LEN.format(500000)])[0] == "ok"
    assert bootlog.verdict_for_labels(labels, [LEN.format(262144)])[0] == "fail"
    assert bootlog.verdict_for_labels({}, [LEN.format(262144)]) is None  # an older container: no recipe
    assert bootlog.verdict_for_labels({"org.flash.recipe": '{"NOPE":"1"}'}, [LEN.format(1)]) is None
