"""`flash export sparkrun` checked by sparkrun's own loader (issue 36): sparkrun 0.4.2 (its own
Python 3.12 venv, made by tests/support/tier-engine.sh) loads the recipe, finds no structural or
metadata problem, and renders a command whose argv is `flash serve`'s, with the model path under
sparkrun's cache mount and its `-o` overrides landing on the right flags. Runs with the engine tier
(the real outside tools); it needs no Docker itself."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from flash_cli.settings import resolve
from flash_cli.spec import build

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("FLASH_TEST_CACHE", Path.home() / ".cache" / "flash-tests")) / "sparkrun-0.4.2"
LOAD = """
import json, sys
from sparkrun.core.recipe import Recipe
r = Recipe.load(sys.argv[1])
out = {"structure": r.validate_structure(), "metadata": r.validate_metadata(), "runtime": r.runtime,
       "mode": r.mode, "container": r.container, "model": r.model, "revision": r.model_revision, "env": r.env}
for name, over in (("plain", {}), ("over", json.loads(sys.argv[2]))):
    out[name] = r.render_command(r.build_config_chain(over))
print(json.dumps(out))
"""


def sparkrun_python() -> str:
    py = VENV / "bin" / "python"
    if not py.exists():
        pytest.fail(f"no sparkrun venv at {VENV}: tests/support/tier-engine.sh makes it (tests/run engine)")
    return str(py)


@pytest.mark.parametrize("profile", ["default", "published"])
def test_sparkrun_loads_the_recipe_and_renders_serves_argv(profile, tmp_path):
    py = sparkrun_python()
    snap = "0123456789abcdef0123456789abcdef01234567"
    words = [profile, "API_KEY=off"]
    from flash_cli import recipe, sparkrun

    r = recipe.load(words)
    spec = build(r.settings, profile=profile, snapshot=snap, hf_cache="/data/hf", state_dir="/st")
    f = tmp_path / f"{profile}.yaml"
    f.write_text(sparkrun.recipe_text(spec, r.settings, r.profile))
    res = subprocess.run([py, "-c", LOAD, str(f), json.dumps({"port": 18555, "max_model_len": 131072})],
                         capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["structure"] == [] and got["metadata"] == [], got
    assert got["runtime"].startswith("vllm") and got["mode"] == "solo" and got["container"] == spec.image
    assert got["model"] == r.settings["MODEL"] and got["revision"] == snap
    assert got["env"]["HF_HOME"] == "/cache/huggingface" and "FLASH_API_KEY_FILE" not in got["env"]
    want = [a.replace("/hf/", "/cache/huggingface/", 1) if a.startswith("/hf/") else a for a in spec.command]
    assert shlex.split(got["plain"]) == want  # serve's argv exactly, JSON flags intact
    over = shlex.split(got["over"])
    assert over[over.index("--port") + 1] == "18555" and over[over.index("--max-model-len") + 1] == "131072"
