"""Shared fixtures: tests never touch the user's state (HOME, XDG dirs, HF cache are tmp)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def isolate_state(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    for var in ("XDG_STATE_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("FLASH_DEBUG", raising=False)
    yield home


def _gpu_marked(item) -> bool:
    return any(m.name == "gpu" or m.name.startswith("gpu_") for m in item.iter_markers())


# A gpu-e2e scenario the fleet declares not applicable on the booted base (e.g. the hoisted mode on
# v0.29) is not a skip for lack of hardware: it stays a visible skip, listed with its reason.
DECLARED_NA = "N/A on v"


def _declared_na(item, reason: str) -> bool:
    return any(m.name == "gpu_e2e" for m in item.iter_markers()) and reason.removeprefix("Skipped: ").startswith(DECLARED_NA)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In a selected GPU tier (tests/run sets FLASH_REQUIRE_GPU=1), a GPU test that skips fails:
    the tier proves nothing by skipping. The one exception: a gpu-e2e scenario declared N/A on the
    base (DECLARED_NA), which results.json and summary.txt list as such."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and os.environ.get("FLASH_REQUIRE_GPU") == "1" and _gpu_marked(item):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if _declared_na(item, reason):
            return
        rep.outcome = "failed"
        rep.longrepr = f"skipped inside a selected GPU tier (FLASH_REQUIRE_GPU=1): {reason}"


# Folders that hold only GPU tests: a whole module skipped at import there (e.g. a module-level
# `pytest.importorskip("torch")`) never reaches pytest_runtest_makereport, so it is caught here.
GPU_TEST_DIRS = ("gpu", "gpu_e2e")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """In a selected GPU tier, a GPU test module that skips as a whole is a collection error: the
    tier would otherwise stay green with none of that module's tests run."""
    outcome = yield
    rep = outcome.get_result()
    if (rep.skipped and os.environ.get("FLASH_REQUIRE_GPU") == "1" and isinstance(collector, pytest.Module)
            and collector.path.parent.name in GPU_TEST_DIRS):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"{collector.path.name} skipped as a whole inside a selected GPU tier (FLASH_REQUIRE_GPU=1): {reason}"


# marker → the tests/run tier it selects (a test with none of them is the unit tier's; the fuzz
# tests are unit tests too, which `tests/run fuzz` runs with more cases)
TIER_OF_MARK = {"docker": "engine", "obs": "obs", "vllm": "vllm", "scale": "scale", "gpu_e2e": "gpu-e2e",
                "gpu": "gpu"}


def tier_of(keywords) -> str:
    return next((tier for mark, tier in TIER_OF_MARK.items() if mark in keywords), "unit")


def pytest_terminal_summary(terminalreporter):
    """Each tier's skip reasons, grouped and counted, at the end of the run (tests/run runs the
    tiers in one pytest session, so they are told apart by marker); a tier without skips says so."""
    ran: dict[str, int] = {}
    reasons: dict[str, dict[str, int]] = {}
    for key in ("passed", "failed", "skipped", "xfailed", "xpassed", "error"):
        for rep in terminalreporter.stats.get(key, []):
            if getattr(rep, "when", "call") != "call" and key != "skipped":
                continue
            tier = tier_of(getattr(rep, "keywords", {}))
            ran[tier] = ran.get(tier, 0) + 1
            if key == "skipped":
                reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
                reason = reason.removeprefix("Skipped: ")
                tally = reasons.setdefault(tier, {})
                tally[reason] = tally.get(reason, 0) + 1
    for tier in sorted(ran):
        tally = reasons.get(tier, {})
        terminalreporter.section(f"{tier} tier: {sum(tally.values())} of {ran[tier]} skipped", sep="-")
        for reason, n in sorted(tally.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{n:5d} x {reason}")
