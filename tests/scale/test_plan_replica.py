"""`flash plan` on full-size sparse replicas (real names, shapes, dtypes and header bytes): the
weights read from the headers agree with the geometry the plan falls back to."""

from __future__ import annotations

import pytest

from fakes import ckpt
from flash_cli.plan import build
from flash_cli.plan import weights as W
from flash_cli.geometry import REAL
from flash_cli.plan.hardware import PRESETS
from flash_cli.settings import resolve

pytestmark = [pytest.mark.scale, pytest.mark.timeout(900)]


@pytest.mark.parametrize("flavour, kind", [("nvidia", "nvidia"), ("radixark", "radixark")])
def test_headers_match_the_geometry(tmp_path, flavour, kind):
    ckpt.write_snapshot(tmp_path / "hf", flavour, ckpt.REAL, sparse=True)
    model = ckpt.NVIDIA if flavour == "nvidia" else ckpt.RADIXARK
    for mode in ("nvfp4", "hybrid"):  # hybrid: not prepared, side layers converted on paper
        s = resolve(None, None, {"HF_CACHE": str(tmp_path / "hf"), "MODEL": model, "MODE": mode, "MTP": "2",
                                 "CTX": "500000", "YARN": "1"})
        plan = build(s, PRESETS["gb10"])
        assert plan["weights"]["source"].startswith("headers:")
        geo = W.geometry_estimate(REAL, checkpoint=kind, mode=mode, mtp=2, draft_vocab=True, vision=True)
        for comp, gib in plan["weights"]["gib"].items():
            assert gib == pytest.approx(geo.components[comp] / 1024**3, rel=0.01, abs=0.002), (mode, comp)
        on_disk = plan["weights"]["checkpoint_on_disk_gib"]
        assert on_disk["ple_table"] == pytest.approx(47.684, abs=0.001)
        geo_plan = build(s, PRESETS["gb10"], snapshot=None)
        # same pool within one block whichever way the weights were counted
        assert abs(plan["kv_cache_tokens"] - geo_plan["kv_cache_tokens"]) <= 2 * plan["kv_layout"]["block_size"]
