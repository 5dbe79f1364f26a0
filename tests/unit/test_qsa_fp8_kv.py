"""Patch 7 (fp8 KV on QSA), host side and the source rewrite, without vLLM.

The in-release proof is tests/vllm/release/check_qsa_fp8_kv.py (real 0.29-0.33 classes); the
kernel on a GPU: lab/prove_qsa_fp8_kv_gpu.py (benchmarks/qsa-fp8-kv-h200/README.md).
"""

from __future__ import annotations

import types

import pytest

from flash_cli import preflight
from flash_cli.errors import ConfigError
from flash_cli.settings import resolve
from flash_vllm.patches import p07_qsa_fp8_kv as p7
from flash_vllm.registry import TargetMissing


def test_registry_entry():
    p = p7.PATCH
    assert p.number == 7 and p.applies_to == {"v0.29", "v0.30"} and not p.not_ported
    assert {p.expected_status(b) for b in ("v0.31", "v0.32", "v0.33")} == {"upstream"}
    assert p.expected_status("v0.29") == p.expected_status("v0.30") == "applies"
    assert p.gate.env is None        # on wherever the cache dtype asks for it; bf16 takes the stock path


def runspec(s):
    """The RunSpec serve would run for these settings: what preflight checks."""
    from flash_cli.spec import build

    return build(s, profile="t", snapshot="SNAP", hf_cache="/hf", state_dir="/state")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3"])
def test_preflight_serves_fp8_kv_where_the_patch_applies(kv):
    for base in ("v0.29", "v0.30", "v0.31", "v0.33"):
        assert preflight.fp8_kv_gap(base) is None
        assert preflight.recipe(runspec(resolve(overrides={"KV_DTYPE": kv, "BASE": base}))) == [], base


def test_preflight_still_refuses_a_base_the_catalogue_marks_unported(monkeypatch):
    from fakes.releases import with_cap

    with_cap(monkeypatch, "v0.29", qsa_fp8_kv=None)
    p = preflight.recipe(runspec(resolve(overrides={"KV_DTYPE": "fp8", "BASE": "v0.29"})))
    assert len(p) == 1 and p[0].error is ConfigError
    assert "patch 7" in p[0].message and "qsa_fp8_kv=None" in p[0].message and "KV_DTYPE=auto" in p[0].hint
    assert preflight.recipe(runspec(resolve(overrides={"KV_DTYPE": "auto", "BASE": "v0.29"}))) == []
    assert preflight.recipe(runspec(resolve(overrides={"KV_DTYPE": "fp8", "BASE": "v0.30"}))) == []


KERNEL_SRC = '''
@triton.jit
def k(
    q_ptr,
    output_ptr,
    output_gate_ptr,
    BLOCK_N: tl.constexpr,
) -> None:
    softmax_scale_log2: tl.constexpr = (HEAD_DIM**-0.5) * 1.4426950408889634
    for tile in range(3):
        scores = tl.dot(query, keys)
        scores *= softmax_scale_log2
        accumulator = tl.dot(
            probabilities.to(values.dtype),
            values,
        )
    normalized_output = tl.where(
        has_values[:, None],
        accumulator / tl.maximum(normalizer[:, None], 1.0e-20),
        0.0,
    )
'''


def test_kernel_rewrite_each_anchor_once():
    new = p7.rewrite(KERNEL_SRC, p7.KERNEL_EDITS, "k")
    assert "softmax_scale_log2" not in new
    assert "    output_ptr,\n    softmax_scale,\n    output_scale,\n    output_gate_ptr," in new
    assert "    IS_FP8: tl.constexpr,\n) -> None:" in new
    assert "keys = keys.to(query.dtype)" in new and "values = values.to(tl.float16)" in new
    assert "accumulator * (output_scale / tl.maximum(normalizer, 1.0e-20))[:, None]" in new
    compile(new, "k", "exec")
    with pytest.raises(TargetMissing, match="found 0 times"):
        p7.rewrite(KERNEL_SRC.replace("scores *= softmax_scale_log2", "scores *= s"), p7.KERNEL_EDITS, "k")
    with pytest.raises(TargetMissing, match="found 2 times"):
        p7.rewrite(KERNEL_SRC + KERNEL_SRC, p7.KERNEL_EDITS, "k")


def test_function_source_and_compile_into_keep_source_readable(tmp_path):
    import inspect
    import sys

    (tmp_path / "p7mod.py").write_text("def deco(f):\n    return f\n\n@deco\ndef g(x):\n    return x + 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import p7mod
        src = p7.function_source(p7mod, "g")
        assert src.startswith("@deco\ndef g(x):")
        ns = dict(vars(p7mod))
        g2 = p7.compile_into(ns, src.replace("x + 1", "x + 2"), "g", "g")
        assert g2(1) == 3 and p7mod.g(1) == 2
        assert "x + 2" in inspect.getsource(g2)        # what Triton's JIT reads
        with pytest.raises(TargetMissing):
            p7.function_source(p7mod, "missing")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("p7mod", None)


def test_impl_init_wrapper_hands_auto_to_the_probe_and_restores():
    seen = []

    def orig(self, *args, **kwargs):
        seen.append(args[6] if len(args) > 6 else kwargs.get("kv_cache_dtype"))
        self.kv_cache_dtype = seen[-1]

    init = p7._make_impl_init(orig)
    for want, call in (("fp8", lambda o: init(o, 1, 2, 3, 4, None, None, "fp8")),
                       ("fp8_e4m3", lambda o: init(o, 1, 2, 3, 4, None, None, kv_cache_dtype="fp8_e4m3")),
                       ("auto", lambda o: init(o, 1, 2, 3, 4, None, None, "auto"))):
        o = types.SimpleNamespace()
        call(o)
        assert o.kv_cache_dtype == want
    assert seen == ["auto", "auto", "auto"]
