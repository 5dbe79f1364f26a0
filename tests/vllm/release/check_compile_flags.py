"""compile_config.compilation_config models what vLLM's own argument parser makes of the compilation
flags a user puts in COMPILE_FLAGS / EXTRA (the check that keeps FULL CUDA graphs away from the
PLE gather relies on it): compare it with the release's real FlexibleArgumentParser."""

from __future__ import annotations

import json

import pytest

PIECEWISE = ["--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE"})]
ARGVS = [
    PIECEWISE,
    ["-cc", json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 64})],
    ["--compilation-config=" + json.dumps({"cudagraph_mode": "NONE"})],
    PIECEWISE + ["-cc.max_cudagraph_capture_size=64"],  # a dotted key drops the JSON config whole
    PIECEWISE + ["-cc.cudagraph_mode", "FULL", "-cc.max_cudagraph_capture_size", "32"],
    PIECEWISE + ["-cc", json.dumps({"cudagraph_mode": "FULL_AND_PIECEWISE"})],  # the last JSON wins
    ["-cc.cudagraph_mode=PIECEWISE", "--compilation-config.splitting_ops", json.dumps(["vllm::unified_attention"])],
    ["-cc.splitting_ops+=vllm::a,vllm::b", "-cc.cudagraph_mode=PIECEWISE"],
    ["-cc.pass_config.fuse_norm_quant=true", "-cc.cudagraph_mode=PIECEWISE"],
]


@pytest.fixture(scope="module")
def parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # Building the CLI instantiates every config's defaults, DeviceConfig's "auto" included, which
    # needs a platform: this CPU box has none (the other checks pass device="cpu" explicitly).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(current_platform), "device_type", "cpu", raising=False)
        yield EngineArgs.add_cli_args(FlexibleArgumentParser())


def vllm_sets(parser, argv):
    """The keys the user set, as vLLM parsed them (the config object's own defaults left out)."""
    from vllm.config import CompilationConfig

    cc = parser.parse_args(argv).compilation_config
    if isinstance(cc, dict):
        return cc
    assert isinstance(cc, CompilationConfig), type(cc)
    return cc


@pytest.mark.parametrize("argv", ARGVS, ids=[" ".join(a)[:60] for a in ARGVS])
def test_model_matches_vllms_parser(parser, argv):
    from flash_cli.compile_config import compilation_config

    ours = compilation_config(argv)
    theirs = vllm_sets(parser, argv)
    if isinstance(theirs, dict):
        assert ours == theirs
        return
    # Parsed into a CompilationConfig: every key we predict is set to what we predict, and the
    # graph mode (what preflight decides on) is identical, default included.
    for key, value in ours.items():
        got = getattr(theirs, key)
        if key == "cudagraph_mode":
            assert got is not None and got.name == str(value).upper(), (key, got, value)
        elif isinstance(value, dict):
            for k2, v2 in value.items():
                assert getattr(got, k2) == v2, (key, k2)
        else:
            assert got == value, (key, got, value)
    if "cudagraph_mode" not in ours:
        assert theirs.cudagraph_mode is None or theirs.cudagraph_mode.name == "FULL_AND_PIECEWISE"
