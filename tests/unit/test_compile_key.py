"""The plugin's compile-cache key (flash_vllm/compile_key.py), without vLLM (a fake VllmConfig)."""

from __future__ import annotations

import ast
import logging
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flash_vllm import compat, compile_key, plugin
from flash_vllm.registry import Context, Gate, Patch, TargetMissing, catalogue

SRC = Path(__file__).resolve().parents[2] / "src"
# The default recipe's patch set on 0.33 (patch 1 eager, exact top-k).
ON = [1, 2, 3, 4, 5, 8, 13]
ENV = {"VLLM_PLE_MMAP": "1", "VLLM_QSA_EXACT_TOPK": "1"}


def key(applied=ON, env=ENV, base="v0.33"):
    return compile_key.key_of(compile_key.signature(base, applied, env))


def test_deterministic_and_short():
    k = key()
    assert k == key() and re.fullmatch(r"[0-9a-f]{16}", k)
    assert key(applied=list(reversed(ON))) == k  # the order patches applied in is not state
    assert key(env=dict(reversed(list(ENV.items())))) == k


def test_same_key_in_another_process():
    """No per-process salt (str hash randomisation, set order): a reboot finds its artifact."""
    code = ("from flash_vllm import compile_key as c; "
            f"print(c.key_of(c.signature('v0.33', {ON!r}, {ENV!r})))")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == key()


@pytest.mark.parametrize("applied", [
    [2, 3, 4, 5, 8, 13],        # patch 1 off (FLASH_DISABLE_PATCHES=1 or VLLM_PLE_MMAP=0)
    [1, 2, 3, 4, 5, 8],         # patch 13 off
    [1, 2, 3, 4, 5, 8, 10, 13],  # patch 10 on
])
def test_changes_when_a_patch_toggles(applied):
    assert key(applied=applied) != key()


@pytest.mark.parametrize("extra", [
    {"VLLM_PLE_MMAP_MODE": "hoisted"},   # patch 1: gather before the forward instead of inside it
    {"VLLM_PLE_MMAP_DEBUG": "1"},        # patch 1: the cross-checking forward
    {"VLLM_PLE_MMAP_HOIST_CHECK": "1"},  # patch 1: the hoisted forward's id comparison
    {"VLLM_QSA_EXACT_TOPK": "fill"},     # patches 5/8: the other hook body
    {"VLLM_QSA_EXACT_TOPK": "0", "VLLM_QSA_DET_TOPK": "1"},
])
def test_changes_when_a_traced_knob_changes(extra):
    assert key(env={**ENV, **extra}) != key()


def test_changes_with_the_base():
    assert key(base="v0.32") != key()


@pytest.mark.parametrize("extra", [
    {"VLLM_PORT": "8123"}, {"PORT": "9000"},
    {"VLLM_PLE_MMAP_DIR": "/models/elsewhere"}, {"VLLM_PLE_MMAP_WORKERS": "7"},
    {"VLLM_PLE_MMAP_IO": "mmap"}, {"VLLM_PLE_MMAP_CHUNK": "64"}, {"VLLM_PLE_MMAP_STATS_SEC": "0"},
    {"VLLM_MTP_DRAFT_VOCAB": "/data/ids.npy"}, {"VLLM_CACHE_ROOT": "/tmp/x"}, {"HF_HOME": "/hf"},
    {"VLLM_PLE_MMAP_MODE": "eager"},      # the default, spelled out
    {"VLLM_QSA_EXACT_TOPK": "yes"},       # the same mode, spelled otherwise
])
def test_unchanged_by_what_does_not_change_the_traced_code(extra):
    assert key(env={**ENV, **extra}) == key()


def test_a_knob_of_a_patch_that_is_not_applied_is_not_state():
    off = [2, 3, 4, 13]  # neither patch 1 nor 5/8
    assert key(applied=off, env={"VLLM_PLE_MMAP_MODE": "hoisted", "VLLM_QSA_EXACT_TOPK": "fill"}) == \
        key(applied=off, env={})


def test_bad_knob_value_names_the_variable():
    with pytest.raises(ValueError, match=r"VLLM_PLE_MMAP_MODE='sideways' is not one of eager, hoisted"):
        key(env={**ENV, "VLLM_PLE_MMAP_MODE": "sideways"})


def _copy_src(dst: Path) -> Path:
    for pkg in ("flash_vllm", "flash_common"):
        shutil.copytree(SRC / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _source_hash(root: Path) -> str:
    code = "from flash_vllm import compile_key; print(compile_key.source_hash())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(root)),
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_source_hash_follows_the_plugin_source_not_its_location(tmp_path):
    a = _copy_src(tmp_path / "a")
    b = _copy_src(tmp_path / "elsewhere" / "b")
    h = _source_hash(a)
    assert h == compile_key.source_hash() == _source_hash(b)  # installed elsewhere: same key
    (b / "flash_vllm" / "__pycache__").mkdir()
    (b / "flash_vllm" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"junk")
    assert _source_hash(b) == h  # bytecode is not source
    stager = b / "flash_vllm" / "ple" / "stager.py"  # traced code outside patches/ counts too
    stager.write_text(stager.read_text() + "\n# a new flash version\n")
    assert _source_hash(b) != h


PATTERN = re.compile(r"^(VLLM|FLASH)_[A-Z0-9_]*[A-Z0-9]$")
# The PLE engine reads patch 1's variables: its config is patch 1's to classify.
ENGINE_OF = {1: [SRC / "flash_vllm" / "ple" / "config.py"]}


def _env_names_read(files) -> set[str]:
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and PATTERN.match(node.value):
                names.add(node.value)
    return names


def test_every_variable_a_patch_reads_is_classified_on_that_patch():
    """Each patch folder (plus the engine it drives) reads only variables its Patch classifies:
    `traced` (changes what torch.compile traces) or `untraced` (with the reason)."""
    every = set()
    for p in catalogue():
        folder = SRC / "flash_vllm" / "patches" / p.folder
        read = _env_names_read([*folder.rglob("*.py"), *ENGINE_OF.get(p.number, [])])
        every |= read
        unclassified = read - set(p.traced) - set(p.untraced)
        assert not unclassified, (f"patch {p.number} reads {sorted(unclassified)}: declare each on its Patch "
                                  f"(src/flash_vllm/patches/{p.folder}/): traced= (changes what torch.compile "
                                  "traces, with knobs=) or untraced= (with the reason)")
        if p.gate.env:  # a gate variable is either traced state or covered by `applied`
            assert p.gate.env in set(p.traced) | set(p.untraced), p.number
    assert {"VLLM_PLE_MMAP_MODE", "VLLM_QSA_EXACT_TOPK", "VLLM_MTP_DRAFT_VOCAB"} <= every
    registry_reads = _env_names_read([SRC / "flash_vllm" / "registry.py"])
    assert registry_reads == set(compile_key.REGISTRY_UNTRACED) == {"FLASH_DISABLE_PATCHES"}


def test_traced_and_untraced_are_read_off_the_patches():
    traced, untraced = compile_key.traced_env(), set(compile_key.untraced())
    assert not traced & untraced  # no variable traced by one patch and left out by another
    assert compile_key.traced() == {1: ("VLLM_PLE_MMAP_MODE", "VLLM_PLE_MMAP_DEBUG", "VLLM_PLE_MMAP_HOIST_CHECK"),
                                    5: ("VLLM_QSA_EXACT_TOPK", "VLLM_QSA_DET_TOPK"),
                                    8: ("VLLM_QSA_EXACT_TOPK", "VLLM_QSA_DET_TOPK")}
    assert {"VLLM_PLE_MMAP", "VLLM_PLE_MMAP_DIR", "FLASH_EFFORT_ALIAS", "FLASH_DISABLE_PATCHES"} <= untraced
    assert compile_key.knobs([1, 3, 5], {"VLLM_QSA_EXACT_TOPK": "fill"}) == {
        "1": {"mode": "eager", "debug": False, "hoist_check": False}, "5": {"topk": "fill"}}


def test_a_patch_declares_traced_variables_with_their_knobs():
    base = dict(number=99, name="x", title="x", why="x", upstream="x", gate=Gate.always(), targets=("m:f",))
    with pytest.raises(ValueError, match="`traced` and `knobs` come together"):
        Patch(**base, traced=("VLLM_X",))
    with pytest.raises(ValueError, match=r"\['VLLM_X'\] both traced and untraced"):
        Patch(**base, traced=("VLLM_X",), knobs=lambda env: {}, untraced={"VLLM_X": "why"})


# --- the hook, on a fake vllm.config.vllm ---------------------------------------------------

@pytest.fixture
def fake_config(monkeypatch):
    mod = types.ModuleType("vllm.config.vllm")

    class VllmConfig:
        def __init__(self, tag="x"):
            self.tag = tag

        def compute_hash(self, include_version: bool = True) -> str:
            return ("a" if include_version else "b") * 5 + self.tag * 5

    mod.VllmConfig = VllmConfig
    monkeypatch.setitem(sys.modules, "vllm.config.vllm", mod)
    monkeypatch.setattr(compile_key, "_state", {})
    return VllmConfig


def ctx(env=ENV, base="v0.33"):
    return Context(compat.Base(base, "0.33.0", "version"), env)


def test_hook_mixes_the_key_into_vllms_hash(fake_config, caplog):
    plain = fake_config().compute_hash()
    with caplog.at_level(logging.INFO, logger="vllm.flash"):
        sig = compile_key.install(ctx(), ON)
    hooked = fake_config().compute_hash()
    assert hooked != plain and len(hooked) == len(plain) == 10
    assert hooked == compile_key.mix(plain, sig["key"]) == fake_config().compute_hash()
    assert fake_config(tag="y").compute_hash() != hooked  # vLLM's own factors still count
    assert fake_config().compute_hash(include_version=False) == compile_key.mix("bbbbbxxxxx", sig["key"])
    lines = [r.getMessage() for r in caplog.records if "compile-cache key" in r.getMessage()]
    assert len(lines) == 1 and sig["key"] in lines[0] and "patches [1,2,3,4,5,8,13]" in lines[0]
    wrap = fake_config.compute_hash
    other = compile_key.install(ctx(env={**ENV, "VLLM_PLE_MMAP_MODE": "hoisted"}), ON)
    assert fake_config.compute_hash is wrap  # installed once; the key is read at call time
    assert other["key"] != sig["key"] and fake_config().compute_hash() == compile_key.mix(plain, other["key"])
    compile_key.verify()


def test_hook_on_a_0_29_style_compute_hash(fake_config):
    def compute_hash(self):  # 0.29.0: no include_version
        return "0123456789"

    fake_config.compute_hash = compute_hash
    sig = compile_key.install(ctx(base="v0.29"), [1, 2])
    assert fake_config().compute_hash() == compile_key.mix("0123456789", sig["key"]) != "0123456789"


def test_missing_target_stops_register(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.config.vllm", types.ModuleType("vllm.config.vllm"))
    monkeypatch.setattr(plugin, "catalogue", lambda: ())
    plugin.reset_for_tests()
    try:
        with pytest.raises(plugin.PatchFailed, match=r"compile-cache key cannot hook vllm\.config\.vllm:"
                                                       r"VllmConfig\.compute_hash on v0\.33.*not found"):
            plugin.register(env={}, vllm_version="0.33.0")
    finally:
        plugin.reset_for_tests()


def test_register_reports_the_key(fake_config, monkeypatch):
    p = Patch(number=71, name="ok", title="t", why="w" * 50, upstream="u", gate=Gate.always(),
              targets=("x:y",), applies_to=frozenset(compat.ORDER))
    monkeypatch.setattr(plugin, "catalogue", lambda: (p,))
    plugin.reset_for_tests()
    try:
        summary = plugin.register(env={}, vllm_version="0.33.0")
        assert summary["compile_key"] == compile_key.current() == \
            compile_key.key_of(compile_key.signature("v0.33", [71], {}))
    finally:
        plugin.reset_for_tests()


def test_check_refuses_a_non_method(fake_config):
    fake_config.compute_hash = "not a method"
    with pytest.raises(TargetMissing, match="is not a method"):
        compile_key.check()


def test_selfcheck_row(fake_config, monkeypatch):
    from flash_vllm.selfcheck import evaluate_key

    rows = [{"number": 1, "status": "applies"}, {"number": 6, "status": "upstream"}]
    row = evaluate_key(ctx(), rows)
    key = compile_key.key_of(compile_key.signature("v0.33", [1], ENV))
    assert row == {"status": "applies", "detail": f"vllm.config.vllm:VllmConfig.compute_hash (key {key})"}
    monkeypatch.setitem(sys.modules, "vllm.config.vllm", types.ModuleType("vllm.config.vllm"))
    bad = evaluate_key(ctx(), rows)
    assert bad["status"] == "broken" and "VllmConfig" in bad["detail"] and "not found" in bad["detail"]
