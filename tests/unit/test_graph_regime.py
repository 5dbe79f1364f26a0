"""Preflight keeps FULL CUDA graphs (which would replay patch 1's eager PLE gather as a constant) out
of the recipe: COMPILE_FLAGS replaces flash's per-base default and EXTRA can override it. The parser
model is checked against each release's real parser in tests/vllm/release/check_compile_flags.py."""

import json

import pytest

from flash_cli import compile_config, preflight
from flash_cli.errors import ConfigError
from flash_cli.settings import resolve

PW = "'" + json.dumps({"cudagraph_mode": "PIECEWISE"}) + "'"


def runspec(s):
    """The RunSpec serve would run for these settings: what preflight checks."""
    from flash_cli.spec import build

    return build(s, profile="t", snapshot="SNAP", hf_cache="/hf", state_dir="/state")


def problems(**over):
    return [p for p in preflight.recipe(runspec(resolve(overrides=over))) if "cudagraph" in p.message
            or "splitting_ops" in p.message or "COMPILE_FLAGS/EXTRA" in p.message]


@pytest.mark.parametrize("over", [
    {}, {"COMPILE_FLAGS": f"-cc {PW}"}, {"COMPILE_FLAGS": "-O0"}, {"COMPILE_FLAGS": "-O3", "EXTRA": "--enforce-eager"},
    {"EXTRA": "-cc.cudagraph_mode=PIECEWISE -cc.max_cudagraph_capture_size=64"},
    {"EXTRA": "-cc.cudagraph_mode=NONE"},
    {"BASE": "v0.29", "EXTRA": "-cc.cudagraph_mode=PIECEWISE -cc.splitting_ops+=vllm::flash_ple_mmap_lookup,vllm::x"},
])
def test_piecewise_recipes_pass(over):
    assert problems(**over) == []


@pytest.mark.parametrize("over, mode", [
    ({"COMPILE_FLAGS": "-O3"}, "FULL_AND_PIECEWISE"),                      # COMPILE_FLAGS without a mode
    ({"EXTRA": "-cc.max_cudagraph_capture_size=64"}, "FULL_AND_PIECEWISE"),  # a dotted key drops our JSON
    ({"EXTRA": "-cc.cudagraph_mode=FULL_DECODE_ONLY"}, "FULL_DECODE_ONLY"),
    ({"COMPILE_FLAGS": "-cc '" + json.dumps({"cudagraph_mode": "full"}) + "'"}, "FULL"),
])
@pytest.mark.parametrize("gather", [{"PLE_MODE": "eager"}, {"BASE": "v0.29"}])  # eager: asked, or auto's fallback
def test_full_graphs_are_refused_naming_the_mode(over, mode, gather):
    (p,) = problems(**over, **gather)
    assert p.error is ConfigError and f"cudagraph_mode {mode} " in p.message and "PIECEWISE" in p.hint
    assert "PLE_MODE=auto or hoisted" in p.hint and "v0.30, v0.31, v0.32, v0.33" in p.hint


def test_full_graphs_pass_with_the_default_gather_where_hoisted_is_served():
    # PLE_MODE=auto gathers before the forward on v0.30+: vLLM's FULL modes are legal there
    assert problems(COMPILE_FLAGS="-O3") == [] and problems(EXTRA="-cc.cudagraph_mode=FULL_DECODE_ONLY") == []


def test_v029_splitting_ops_without_our_op_are_refused():
    ops = "'" + json.dumps(["vllm::unified_attention"]) + "'"
    (p,) = problems(BASE="v0.29", EXTRA=f"-cc.cudagraph_mode=PIECEWISE -cc.splitting_ops {ops}")
    assert "vllm::flash_ple_mmap_lookup" in p.message and "vllm::flash_ple_mmap_lookup" in p.hint
    assert problems(BASE="v0.33", EXTRA=f"-cc.cudagraph_mode=PIECEWISE -cc.splitting_ops {ops}") == []


def test_unquoted_json_is_named_with_a_quoting_hint():
    (p,) = problems(COMPILE_FLAGS='-cc {"cudagraph_mode":"PIECEWISE"}')  # shlex eats the quotes
    assert "'{cudagraph_mode:PIECEWISE}' is not a JSON object" in p.message and "shlex" in p.hint


def test_op_name_is_the_plugins():
    from flash_vllm.patches.p01_ple_mmap import v029 as ple_mmap_v029

    assert preflight.PLE_OP_V029 == f"vllm::{ple_mmap_v029.OP_NAME}"


def test_parser_model_edge_cases():
    cc = compile_config.compilation_config
    assert cc(["-cc.a.b=1", "-cc.a.c=x"]) == {"a": {"b": 1, "c": "x"}}
    assert cc(["-cc.ops+=a,b"]) == {"ops": ["a", "b"]}
    assert cc(["-cc", '{"x": 1}', "-cc", '{"y": 2}']) == {"y": 2}  # the last JSON wins whole
    assert cc(["-cc.x=1", "--compilation-config.y=2"]) == {"y": 2}  # spellings do not merge in vLLM
    assert cc(["--other", "v"]) == {}
    with pytest.raises(ValueError, match="not a JSON object"):
        cc(["-cc", "[1]"])


def test_hoisted_mode_allows_full_graphs_where_served():
    from flash_cli.spec import compilation_args

    for base in ("v0.30", "v0.31", "v0.32", "v0.33"):
        s = resolve(overrides={"PLE_MODE": "hoisted", "BASE": base})
        assert compilation_args(s) == ["--compilation-config", '{"cudagraph_mode":"FULL_AND_PIECEWISE"}']
    assert problems(PLE_MODE="hoisted", BASE="v0.33") == []
    assert problems(PLE_MODE="hoisted", BASE="v0.33", EXTRA="-cc.cudagraph_mode=FULL_DECODE_ONLY") == []
    # the default (auto) is the hoisted gather + FULL_AND_PIECEWISE where served, eager + PIECEWISE elsewhere
    for base in ("v0.30", "v0.33"):
        assert compilation_args(resolve(overrides={"BASE": base}))[1] == '{"cudagraph_mode":"FULL_AND_PIECEWISE"}'
    assert compilation_args(resolve(overrides={"BASE": "v0.29"}))[1] == '{"cudagraph_mode":"PIECEWISE"}'
    assert compilation_args(resolve(overrides={"PLE_MODE": "eager"}))[1] == '{"cudagraph_mode":"PIECEWISE"}'
    assert problems(BASE="v0.29") == []  # auto is never refused: it falls back


@pytest.mark.parametrize("base", ["v0.29"])
def test_hoisted_mode_is_refused_where_not_served(base):
    from flash_cli.spec import compilation_args

    s = resolve(overrides={"PLE_MODE": "hoisted", "BASE": base})
    assert compilation_args(s)[1] == '{"cudagraph_mode":"PIECEWISE"}'  # the plugin gathers eagerly there
    probs = [p for p in preflight.recipe(runspec(s)) if "PLE_MODE" in p.message]
    (p,) = probs
    assert p.error is ConfigError and f"BASE={base}" in p.message and "v0.30, v0.31, v0.32, v0.33" in p.hint
    # and a FULL mode there is still refused
    (full,) = problems(PLE_MODE="hoisted", BASE=base, EXTRA="-cc.cudagraph_mode=FULL")
    assert "cudagraph_mode FULL " in full.message


def test_hoisted_env_reaches_the_container():
    from flash_cli.spec import container_env

    def mode(**over):
        return container_env(resolve(overrides=over), False)["VLLM_PLE_MMAP_MODE"]

    assert mode(PLE_MODE="hoisted") == "hoisted" and mode(PLE_MODE="eager") == "eager"
    # auto reaches the plugin resolved (the plugin knows only eager and hoisted)
    assert mode() == "hoisted" and mode(BASE="v0.31") == "hoisted" and mode(BASE="v0.29") == "eager"


@pytest.mark.parametrize("env", ["VLLM_PLE_MMAP=0", "FLASH_DISABLE_PATCHES=3,1,5", "VLLM_PLE_MMAP=off NCCL_DEBUG=INFO"])
def test_full_graphs_pass_when_the_user_turned_patch_1_off(env):
    # stock vLLM's PLE storage serves then (the gpu-e2e tier's stock FULL_AND_PIECEWISE baseline)
    assert problems(CONTAINER_ENV=env, EXTRA="-cc.cudagraph_mode=FULL_AND_PIECEWISE") == []


@pytest.mark.parametrize("env", ["VLLM_PLE_MMAP=1", "FLASH_DISABLE_PATCHES=3,10", "NCCL_DEBUG=INFO"])
def test_full_graphs_still_refused_while_patch_1_serves(env):
    (p,) = problems(CONTAINER_ENV=env, PLE_MODE="eager", EXTRA="-cc.cudagraph_mode=FULL_AND_PIECEWISE")
    assert "cudagraph_mode FULL_AND_PIECEWISE " in p.message


@pytest.mark.parametrize("over, mode", [({}, "FULL_AND_PIECEWISE"), ({"PLE_MODE": "eager"}, "PIECEWISE"),
                                        ({"BASE": "v0.29"}, "PIECEWISE")])
def test_graph_tokens_sets_the_capture_size_and_keeps_the_graph_regime(over, mode):
    """GRAPH_TOKENS (shared: 832) only adds max_cudagraph_capture_size: an eager PLE gather stays PIECEWISE."""
    argv = runspec(resolve(overrides={**over, "GRAPH_TOKENS": "832"})).command
    assert compile_config.compilation_config(argv) == {"cudagraph_mode": mode, "max_cudagraph_capture_size": 832}
    assert problems(**over, GRAPH_TOKENS="832") == []
    assert "max_cudagraph_capture_size" not in compile_config.compilation_config(runspec(resolve(overrides=over)).command)


def test_graph_tokens_with_compile_flags_is_refused_not_dropped():
    with pytest.raises(ConfigError) as err:
        runspec(resolve(overrides={"GRAPH_TOKENS": "832", "COMPILE_FLAGS": "-O3"}))
    assert "GRAPH_TOKENS=832" in str(err.value) and "COMPILE_FLAGS" in str(err.value)
