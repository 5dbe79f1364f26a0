"""The release catalogue (flash_common.releases): its API, the registry's refusal of an
unclassified release, and the dry run of adding one (a fake 0.34.0 aliasing 0.33.0) that every
reader follows with no other edit."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fakes.releases import fake_catalogue
from flash_common import releases
from flash_vllm import registry

from tools import check_vllm_release

ROOT = Path(__file__).resolve().parents[2]


def test_catalogue_shape():
    assert releases.ORDER == ("v0.29", "v0.30", "v0.31", "v0.32", "v0.33")
    assert releases.CURRENT in releases.ORDER and releases.NEWEST == releases.ORDER[-1]
    r = releases.get("v0.33")
    assert (r.version, r.image, r.torch) == ("0.33.0", "vllm/vllm-openai:v0.33.0", "2.14.0")
    assert releases.get("v0.29").torch == "2.13.0" and releases.by_version("0.31.0").base == "v0.31"
    with pytest.raises(TypeError):
        r.caps["qsa_fp8_kv"] = None  # read-only


def test_unknown_names_are_clear_errors():
    with pytest.raises(releases.ReleaseError, match=r"unknown vLLM base 'v0.99'; supported: v0.29, .*v0.33"):
        releases.get("v0.99")
    with pytest.raises(releases.ReleaseError, match=r"unknown release capability 'fp8'; known: .*qsa_fp8_kv"):
        releases.cap("v0.33", "fp8")
    with pytest.raises(releases.ReleaseError, match="not a yes/no one"):
        releases.has("v0.33", "dockerfile")
    with pytest.raises(releases.ReleaseError, match="X.Y.Z"):
        releases.since("0.33")
    with pytest.raises(releases.ReleaseError, match="capabilities missing"):
        dataclasses.replace(releases.get("v0.33"), caps={"dockerfile": "Dockerfile"})
    with pytest.raises(releases.ReleaseError, match=r"qsa_fp8_kv='maybe'; accepted"):
        dataclasses.replace(releases.get("v0.33"), caps={**releases.get("v0.33").caps, "qsa_fp8_kv": "maybe"})


def test_capabilities_and_ranges():
    assert releases.has("v0.33", "reasoning_effort_map") and not releases.has("v0.32", "reasoning_effort_map")
    assert releases.cap("v0.29", "ple_storage") == "splitting-op"
    assert releases.since("0.31.0") == {"v0.31", "v0.32", "v0.33"} == releases.upstream_from("0.31.0")
    assert releases.span("0.29.0", until="0.31.0") == {"v0.29", "v0.30"} == releases.where("qsa_fp8_kv", "patch")


def test_registry_refuses_a_release_a_patch_leaves_unclassified(monkeypatch):
    from flash_vllm.patches import p11_block_fp8_mtp as block_fp8_mtp

    p = block_fp8_mtp.PATCH
    assert p.expected_status("v0.33") == "upstream"
    gap = dataclasses.replace(p, upstream_in=p.upstream_in - {"v0.33"})
    with pytest.raises(registry.Unclassified, match=r"patch 11 \(block-fp8-mtp\) does not say what it does on v0.33"):
        gap.expected_status("v0.33")
    monkeypatch.setattr(block_fp8_mtp, "PATCH", gap)
    with pytest.raises(registry.Unclassified, match="v0.33"):
        registry.catalogue.__wrapped__()  # the registry does not load
    monkeypatch.setattr(block_fp8_mtp, "PATCH", dataclasses.replace(gap, not_needed=frozenset({"v0.33"})))
    assert registry.catalogue.__wrapped__()[10].expected_status("v0.33") == "not-needed"


DRY_RUN = textwrap.dedent(r'''
    import contextlib, io, json, sys
    from flash_common import releases
    from flash_cli import profiles, spec, render
    from flash_cli.settings import BY_NAME, resolve
    from flash_cli.commands import setup
    from flash_cli.__main__ import main
    from flash_vllm import compat, registry

    out = {"order": releases.ORDER, "current": releases.CURRENT,
           "base_default": BY_NAME["BASE"].default, "base_choices": list(BY_NAME["BASE"].choices)}
    p = profiles.load("default")
    s = resolve(p.layer(), {}, {}, profile_name=p.name)
    r = spec.build(s, profile=p.name, snapshot="0" * 40, hf_cache="/hf-cache", state_dir="/state")
    out["profile_base"] = s["BASE"]
    out["run"] = render.to_docker_run(r)
    out["build_args"] = setup.build_args(s)
    out["dockerfile"] = setup.dockerfile_for(s["BASE"])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["patches", "--expected", "--json"])
    out["patches_rc"] = rc
    out["patches"] = json.loads(buf.getvalue())
    out["compat"] = compat.resolve("0.34.0", {}).name
    out["registry"] = {p.name: p.expected_status("v0.34") for p in registry.catalogue()}
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    root = fake_catalogue(tmp_path_factory.mktemp("fake-0.34"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT / "src"), str(ROOT / "tests")])}
    env.pop("BASE", None)
    proc = subprocess.run([sys.executable, "-c", DRY_RUN], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_patches_doc.py"), "--print"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert doc.returncode == 0, doc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), doc.stdout, root


def test_dry_run_copy_differs_in_the_catalogue_alone(dry_run):
    root = dry_run[2]
    real = Path(releases.__file__).resolve().parent
    changed = [f.name for f in sorted((root / "flash_common").glob("*.py"))
               if f.read_text() != (real / f.name).read_text()]
    assert changed == ["releases.py"]


def test_dry_run_settings_and_profiles_follow(dry_run):
    out = dry_run[0]
    assert out["order"][-1] == "v0.34" and out["current"] == "v0.34"
    assert out["base_default"] == "v0.34" and out["base_choices"][0] == "v0.34"
    assert out["profile_base"] == "v0.34"  # profiles/default.env says `# base: current`


def test_dry_run_run_spec_follows(dry_run):
    run = dry_run[0]["run"]
    assert "flash-vllm:v0.34" in run and "org.flash.base=v0.34" in run
    assert "--reasoning-effort-map" in run  # the capability came with the alias, not a name check
    assert not any(a.startswith("FLASH_EFFORT_ALIAS") for a in run)
    assert dry_run[0]["dockerfile"] == "Dockerfile"
    assert dry_run[0]["build_args"] == {"SELFCHECK": "1", "FLASH_VLLM_BASE": "v0.34",
                                        "BASE_IMAGE": "vllm/vllm-openai:v0.34.0"}  # until the Dockerfile is restamped


def test_dry_run_registry_and_flash_patches_follow(dry_run):
    out = dry_run[0]
    assert out["compat"] == "v0.34"
    want = {p.name: p.expected_status("v0.33") for p in registry.catalogue()}
    assert out["registry"] == want  # every patch classified the new release as it does its alias
    assert out["patches_rc"] == 0 and out["patches"]["base"] == "v0.34"
    assert {p["name"]: p["status"] for p in out["patches"]["patches"]} == want


def test_dry_run_patches_doc_follows(dry_run):
    doc = dry_run[1]
    header = next(ln for ln in doc.splitlines() if ln.startswith("| # | patch |"))
    assert header.endswith("| v0.33 (0.33.0) | v0.34 (0.34.0) |")
    row = next(ln for ln in doc.splitlines() if ln.startswith("| 12 |"))
    assert row.endswith("| upstream | upstream |")
    assert "Files a real addition touches: **5**" in doc


def _tool():
    return check_vllm_release


def test_propose_reads_capabilities_from_source_markers():
    """--propose on a synthetic wheel's files (the vllm tier runs it on the real wheels)."""
    files = {
        "vllm/compilation/breakable_cudagraph.py": "",
        "vllm/models/qwen4_exp/nvidia/ngram_embedding.py": "from ..common import Qwen4ExpPLEPinnedHostEmbedding",
        "vllm/models/qwen4_exp/common/ngram_embedding.py": "if isinstance(quant_config, ModelOptMixedPrecisionConfig):",
        "vllm/models/qwen4_exp/nvidia/qsa.py": 'supported_kv_cache_dtypes = [\n "auto",\n "fp8_e4m3",\n]\n',
        "vllm/models/qwen4_exp/nvidia/ops/qsa_indexer.py": "def _topk(\n",
        "vllm/renderers/params.py": "return effort_map.get(effort, effort)",
        "vllm/model_executor/layers/mamba/abstract.py": "def get_mamba_prefill_checkpoint_alignment(",
        "vllm/models/qwen4_exp/nvidia/model_state.py": "    def prepare_inputs(\n",
        "vllm/config/speculative.py": "    disable_eagle_block_drop: bool = False\n"
                                      "    num_speculative_tokens_per_batch_size: list | None = None\n",
        "vllm/v1/engine/core.py": "            vllm_config.cache_config.block_size = min(\n"
                                  "                participating\n                if participating\n",
        "vllm/v1/core/sched/scheduler.py": "        self.num_hash_lookahead_tokens = vllm_config.num_hash_lookahead_tokens\n",
    }
    caps, entry = _tool().propose_from("0.34.0", "2.15.0", files.get, set(files))
    assert caps == {**releases.get("v0.33").caps, "overhead_fitted": False}
    assert entry.startswith('    _release("0.34.0", "2.15.0", dockerfile=\'Dockerfile\', ple_storage=\'storage\'')
    assert "ring_state_bucket: no source marker" in entry
    bare = {k: v for k, v in files.items() if "qsa" not in k and "ngram" not in k}
    caps, entry = _tool().propose_from("0.34.0", "2.15.0", bare.get, set(bare))
    assert caps["qsa_fp8_kv"] is None and caps["ple_storage"] is None and caps["qsa_topk_site"] is None
    inline = dict(bare, **{"vllm/models/qwen4_exp/nvidia/ops/qsa.py": "def qsa_select_paged_tokens(\n"})
    assert _tool().propose_from("0.34.0", "2.15.0", inline.get, set(inline))[0]["qsa_topk_site"] == "select-paged-tokens"
    assert caps["spec_tokens_per_batch_size"] and caps["spec_eagle_block_drop_flag"]
    assert not caps["ple_hoisted"]  # no storage flavour, no hoisted mode
    assert not caps["ple_fp8_modelopt"]  # 0.29's gate: the fp8 table only under Fp8Config
    assert caps["block_size_prefix_groups"]
    no_lookahead = {k: v for k, v in files.items() if "sched" not in k}  # 0.29-0.32: the drafter's block drop
    assert not _tool().propose_from("0.34.0", "2.15.0", no_lookahead.get, set(no_lookahead))[0]["mtp_hash_lookahead"]
    every_group = dict(files, **{"vllm/v1/engine/core.py": "cache_config.block_size = min(\n"
                                 "    g.kv_cache_spec.block_size for g in kv_cache_groups\n)\n# participating later"})
    assert not _tool().propose_from("0.34.0", "2.15.0", every_group.get, set(every_group))[0]["block_size_prefix_groups"]
    old_spec = dict(files, **{"vllm/config/speculative.py": "    num_speculative_tokens_per_batch_size: list\n"})
    caps, _ = _tool().propose_from("0.34.0", "2.15.0", old_spec.get, set(old_spec))
    assert caps["spec_tokens_per_batch_size"] and not caps["spec_eagle_block_drop_flag"]
    assert "port patch 1 before serving" in entry and "patch 7 ships code" in entry
