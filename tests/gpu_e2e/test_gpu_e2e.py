"""gpu-e2e tier (pytest marker `gpu_e2e`, `tests/run gpu-e2e`): one test per scenario of fleet.py.

The selected tests' scenarios run once per session through fleet.run_selected (servers booted
together, results under $FLASH_E2E_OUT); each test then asserts its scenario's verdict. Without
CUDA every test fails with fleet's message (a GPU tier that cannot run must not look green). A
scenario fleet reports N/A on the base skips with the reason, "N/A on vX.Y: why" (tests/conftest.py
turns any other skip inside a selected GPU tier into a failure; results.json and summary.txt list it
as N/A); a selection with nothing applicable fails.
"""

from __future__ import annotations

import pytest

import fleet

pytestmark = pytest.mark.gpu_e2e


@pytest.fixture(scope="session")
def verdicts(request):
    names = sorted({item.callspec.params["scenario"] for item in request.session.items
                    if hasattr(item, "callspec") and "scenario" in item.callspec.params})
    return fleet.run_selected([fleet.SCENARIOS[n] for n in names])


@pytest.mark.parametrize("scenario", list(fleet.SCENARIOS))
def test_scenario(scenario, verdicts):
    if "error" in verdicts and "scenarios" not in verdicts:
        pytest.fail(verdicts["error"])
    if not fleet.ran_verdicts(verdicts):
        pytest.fail(f"no selected scenario applies on {verdicts.get('base')}: nothing was proven")
    got = verdicts["scenarios"][scenario]
    if "na" in got:  # not applicable on this base: reported, never a pass
        pytest.skip(f"N/A on {verdicts.get('base')}: {got['na']}")
    assert got["ok"], got.get("error")
