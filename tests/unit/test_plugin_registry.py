"""flash_vllm's registry, base gate and install machinery, without vLLM (fake vllm.* modules)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from flash_vllm import compat, plugin
from flash_vllm.registry import (
    STATUSES, Gate, Patch, TargetMissing, catalogue, expect_installed, expect_source,
    install, patchset_hash, resolve,
)

ALL = set(compat.ORDER)


def test_catalogue_loads_without_vllm():
    code = ("import sys; from flash_vllm.registry import catalogue; catalogue(); "
            "import flash_vllm.selfcheck, flash_vllm.plugin; assert 'vllm' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('vllm'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_patch_is_a_documented_unit():
    numbers = [p.number for p in catalogue()]
    assert numbers == sorted(set(numbers))
    assert {2, 4, 5, 6, 7, 8, 9, 10, 11, 12} <= set(numbers)
    for p in catalogue():
        assert p.name and p.title and len(p.why) > 40 and p.upstream and p.targets, p.number
        assert (p.applies_to | p.upstream_in | set(p.not_ported)) <= ALL
        for base in compat.ORDER:
            assert p.expected_status(base) in STATUSES
        if p.applies_to:
            assert p.apply.__name__ != "_nothing" and p.check.__name__ != "_nothing", p.number
        if p.upstream_in:
            assert p.upstream_check is not None, f"patch {p.number}: 'upstream' must be read from the release"


@pytest.mark.parametrize("number, base, status", [
    (11, "v0.29", "applies"), (11, "v0.30", "upstream"), (11, "v0.33", "upstream"),
    (12, "v0.32", "applies"), (12, "v0.33", "upstream"),
    (7, "v0.29", "applies"), (7, "v0.30", "applies"), (7, "v0.31", "upstream"),
    (9, "v0.29", "upstream"), (6, "v0.33", "upstream"),
    (4, "v0.33", "applies"), (5, "v0.29", "applies"), (8, "v0.33", "applies"),
])
def test_expected_status_per_base(number, base, status):
    from flash_vllm.registry import by_number

    assert by_number(number).expected_status(base) == status


@pytest.mark.parametrize("version, env, base", [
    ("0.33.0", {}, "v0.33"), ("0.30.1", {}, "v0.30"), ("0.29.0+cu130", {}, "v0.29"),
    ("0.33.0", {"FLASH_VLLM_BASE": "v0.33"}, "v0.33"),
    ("0.1.dev20073+g8e685d198", {"FLASH_VLLM_BASE": "v0.30"}, "v0.30"),
])
def test_base_resolution(version, env, base):
    assert compat.resolve(version, env).name == base


def _next_release(patch: int = 0) -> str:
    """A release one minor line past the catalogue's newest (what a new vLLM release looks like)."""
    major, minor, _ = compat.BASES[compat.NEWEST].split(".")
    return f"{major}.{int(minor) + 1}.{patch}"


@pytest.mark.parametrize("version, env, match", [
    ("0.33.0", {"FLASH_VLLM_BASE": "v0.29"}, "rebuild the image"),
    ("0.1.dev20073+g8e685d198", {}, "development build"),
    (_next_release(), {}, f"check_vllm_release.py {_next_release()} --propose"),
    ("0.28.0", {}, "predates"),
    ("0.33.0", {"FLASH_VLLM_BASE": "v0.99"}, "not a supported base"),
])
def test_base_resolution_refuses(version, env, match):
    with pytest.raises(compat.CompatError, match=match):
        compat.resolve(version, env)


def test_newer_release_is_checked_against_newest_base():
    assert compat.base_for_release(_next_release(2)) == compat.NEWEST
    assert compat.base_for_release("0.31.0") == "v0.31"
    b = compat.resolve(_next_release(), {}, assume=compat.NEWEST)
    assert b.name == compat.NEWEST and b.provisional


def test_gates_and_kill_switch():
    from flash_vllm.registry import by_number

    p5, p12 = by_number(5), by_number(12)
    assert p5.enabled({"VLLM_QSA_EXACT_TOPK": "fill"}) and p5.enabled({"VLLM_QSA_EXACT_TOPK": "1"})
    assert not p5.enabled({"VLLM_QSA_EXACT_TOPK": "0"}) and not p5.enabled({})
    assert p12.enabled({"FLASH_EFFORT_ALIAS": "1"}) and not p12.enabled({"FLASH_EFFORT_ALIAS": "0"})
    assert by_number(4).enabled({}) and not by_number(4).enabled({"FLASH_DISABLE_PATCHES": "3, 4"})
    assert by_number(10).enabled({"VLLM_MTP_DRAFT_VOCAB": "default"})
    assert not by_number(10).enabled({"VLLM_MTP_DRAFT_VOCAB": "0"})


# --- install machinery on fake vllm.* modules ----------------------------------------------------

@pytest.fixture()
def fake_vllm(monkeypatch):
    target = types.ModuleType("vllm._flash_unit_target")
    exec("def helper(x):\n    '''doc'''\n    return x + 1\n\nclass Box:\n    def size(self):\n        return 8\n",
         target.__dict__)
    early = types.ModuleType("vllm._flash_unit_early")
    early.helper = target.helper  # `from target import helper` before the patch
    other = types.ModuleType("vllm._flash_unit_other")
    other.helper = lambda x: x  # an unrelated function of the same name
    for m in (target, early, other):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    return target, early, other


def test_install_rebinds_stale_names_and_is_idempotent(fake_vllm):
    target, early, other = fake_vllm
    make_calls = []

    def make(orig):
        make_calls.append(orig)
        return lambda x: orig(x) * 10

    new = install(90, target.__name__, "helper", make)
    assert target.helper is new and early.helper is new and other.helper is not new
    assert new(1) == 20 and new.__flash_original__(1) == 2
    assert install(90, target.__name__, "helper", make) is new and len(make_calls) == 1
    expect_installed(90, target.__name__, "helper")


def test_install_methods_and_missing_targets(fake_vllm):
    target, _, _ = fake_vllm
    install(91, target.__name__, "Box.size", lambda orig: lambda self: orig(self) * 2)
    assert target.Box().size() == 16
    with pytest.raises(TargetMissing, match="not found"):
        resolve(target.__name__, "Box.volume")
    with pytest.raises(TargetMissing, match="cannot import"):
        resolve("vllm._flash_unit_missing", "x")
    with pytest.raises(TargetMissing, match="not our replacement"):
        expect_installed(92, target.__name__, "Box.size")


def test_expect_source_anchors(fake_vllm, tmp_path, monkeypatch):
    mod = tmp_path / "vllm_flash_unit_src.py"
    mod.write_text("def f(block_size):\n    return block_size // 8\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "// 8" in expect_source("vllm_flash_unit_src", "f", "block_size // 8")
    with pytest.raises(TargetMissing, match="no longer contains"):
        expect_source("vllm_flash_unit_src", "f", "mamba_block_size")


def test_register_raises_on_missing_target_and_is_idempotent(monkeypatch):
    calls = []
    vconf = types.ModuleType("vllm.config.vllm")  # register() also hooks the compile-cache key here
    vconf.VllmConfig = type("VllmConfig", (), {"compute_hash": lambda self: "0123456789"})
    monkeypatch.setitem(sys.modules, "vllm.config.vllm", vconf)

    def check(ctx):
        raise TargetMissing("vllm.fake:thing not found")

    bad = Patch(number=70, name="fake", title="t", why="w" * 50, upstream="u", gate=Gate.flag("FLASH_FAKE"),
                targets=("vllm.fake:thing",), applies_to=frozenset(ALL), check=check)
    good = Patch(number=71, name="ok", title="t", why="w" * 50, upstream="u", gate=Gate.always(),
                 targets=("x:y",), applies_to=frozenset({"v0.33"}), apply=lambda ctx: calls.append(ctx.base.name))
    monkeypatch.setattr(plugin, "catalogue", lambda: (bad, good))
    plugin.reset_for_tests()
    try:
        with pytest.raises(plugin.PatchFailed, match=r"patch 70 \(fake\) cannot apply on v0.33"):
            plugin.register(env={"FLASH_FAKE": "1"}, vllm_version="0.33.0")
        plugin.reset_for_tests()
        summary = plugin.register(env={}, vllm_version="0.33.0")  # gate off: not touched
        assert summary["applied"] == [71] and "70:off" in summary["skipped"]
        assert plugin.register(env={}, vllm_version="0.33.0") is summary and calls == ["v0.33"]
    finally:
        plugin.reset_for_tests()


def test_patchset_hash_is_stable():
    h = patchset_hash()
    assert len(h) == 16 and int(h, 16) >= 0 and patchset_hash() == h


def test_draft_vocab_ids_validation(tmp_path):
    import numpy as np

    from flash_vllm.patches.p10_mtp_draft_vocab import DraftVocabError, load_ids, resolve_path

    p = tmp_path / "ids.npy"
    np.save(p, np.array([5, 1, 3], dtype=np.int32))
    assert load_ids(p, vocab_size=6).tolist() == [1, 3, 5]
    with pytest.raises(DraftVocabError, match=r"\[0, 5\)"):
        load_ids(p, vocab_size=5)
    np.save(p, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(DraftVocabError, match="1-D"):
        load_ids(p)
    with pytest.raises(DraftVocabError, match="does not exist"):
        load_ids(tmp_path / "none.npy")
    assert resolve_path("") is None and resolve_path("/x/y.npy").as_posix() == "/x/y.npy"


def test_effort_map_arg_matches_map():
    import json

    from flash_vllm.patches.p12_effort_alias import EFFORT_MAP, REASONING_EFFORT_MAP_ARG

    assert json.loads(REASONING_EFFORT_MAP_ARG) == EFFORT_MAP == {"high": "xhigh", "max": "xhigh", "minimal": "low"}


def test_patches_doc_and_dockerfile_patchset_are_current():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "tools" / "gen_patches_doc.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name in ("Dockerfile", "Dockerfile.v0.29"):
        assert f"ARG PATCHSET={patchset_hash()}" in (root / name).read_text()


def test_flash_patches_expected_matrix_json():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "flash_cli", "patches", "--expected", "--base", "v0.29", "--json"],
                          capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["base"] == "v0.29" and out["patchset"] == patchset_hash()
    by = {p["number"]: p["status"] for p in out["patches"]}
    assert by[11] == "applies" and by[7] == "applies" and by[9] == "upstream"
    row = next(p for p in out["patches"] if p["number"] == 1)
    assert row["folder"] == "p01_ple_mmap" and "VLLM_PLE_MMAP_MODE" in row["traced"]
    text = subprocess.run([sys.executable, "-m", "flash_cli", "patches", "--expected", "--base", "v0.29"],
                          capture_output=True, text=True, cwd=root, check=True).stdout
    assert "traces VLLM_QSA_EXACT_TOPK, VLLM_QSA_DET_TOPK" in text and "src/flash_vllm/patches/pNN_name/" in text
    bad = subprocess.run([sys.executable, "-m", "flash_cli", "patches", "--expected", "--base", "v0.28"],
                         capture_output=True, text=True, cwd=root)
    assert bad.returncode == 2 and "v0.28" in bad.stderr


def test_patches_are_the_folders_on_disk():
    """Each folder is one patch, named for its number and name; the registry lists nothing by hand."""
    from pathlib import Path

    from flash_vllm import registry

    here = Path(registry.__file__).resolve().parent / "patches"
    on_disk = sorted(d.name for d in here.iterdir() if (d / "__init__.py").is_file())
    assert [p.folder for p in catalogue()] == on_disk == registry.folders()
    assert registry.folder_name(1, "ple-mmap") == "p01_ple_mmap"
    assert registry.module_of(catalogue()[0]).PATCH is catalogue()[0]
    assert not [f for f in here.glob("*.py") if f.name != "__init__.py"], "patch code lives in its folder"


@pytest.mark.parametrize("folder, body, match", [
    ("extra", "", r"patches/extra is not a patch folder; patch folders are named pNN_name"),
    ("p14_orphan", "", r"patches/p14_orphan has no PATCH"),
    ("p14_wrong_name", "from flash_vllm.patches.p02_fla_sm121 import PATCH\n",
     r"patches/p14_wrong_name declares patch 2 \(fla-sm121\); its folder must be named p02_fla_sm121"),
])
def test_a_stray_or_misnamed_folder_stops_the_registry(tmp_path, folder, body, match):
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    for pkg in ("flash_vllm", "flash_common"):
        shutil.copytree(src / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "flash_vllm" / "patches" / folder).mkdir()
    (tmp_path / "flash_vllm" / "patches" / folder / "__init__.py").write_text(body)
    proc = subprocess.run([sys.executable, "-c", "from flash_vllm.registry import catalogue; catalogue()"],
                          capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1
    import re

    assert re.search(match, proc.stderr), proc.stderr[-800:]
