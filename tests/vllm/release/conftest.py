"""Fixtures for the checks that run *inside* a release venv (tools/check_vllm_release.py builds it).

The outer test (tests/vllm/test_releases.py) runs these files with the release venv's Python:
`python -m pytest tests/vllm/release -o python_files=check_*.py`. Nothing here imports vLLM at
module level, so the project venv's pytest can load this conftest without vLLM.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session", autouse=True)
def vllm_config():
    """A default VllmConfig on the CPU device, current for the session (layers read it at init)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        yield cfg


@pytest.fixture(scope="session")
def base():
    from flash_vllm import compat

    return compat.resolve(compat.installed_vllm_version(), {}).name


@pytest.fixture(scope="session")
def draft_ids(tmp_path_factory):
    """Our own id set (the shipped one comes from the checkpoint pipeline): every 3rd id + specials."""
    ids = np.unique(np.concatenate([np.arange(0, 512, 3), np.array([7, 500, 511])])).astype(np.int64)
    path = tmp_path_factory.mktemp("vocab") / "ids.npy"
    np.save(path, ids)
    return ids, path


@pytest.fixture(scope="session")
def gates(draft_ids):
    return {
        "VLLM_QSA_EXACT_TOPK": "1",
        "VLLM_QSA_DET_TOPK": "1",
        "VLLM_MTP_DRAFT_VOCAB": str(draft_ids[1]),
        "FLASH_EFFORT_ALIAS": "1",
        "VLLM_FP8_HYBRID": "1",
    }


@pytest.fixture(scope="session")
def registered(gates):
    """flash_vllm.register() once for the session, with every gate on (as a serving process)."""
    from flash_vllm import plugin

    plugin.reset_for_tests()
    summary = plugin.register(env=gates)
    return summary


@contextlib.contextmanager
def _cpu_world(tmp_path_factory, model_dir, cfg=None):
    """A single-process vLLM world on CPU for building the release's layers: a current VllmConfig
    (a fresh CPU one unless `cfg` is given) whose model path is `model_dir` (what patch 1 reads),
    gloo TP/ETP groups of size 1 (gloo_world.py); torn down on exit, `cfg`'s own model config put
    back."""
    from types import SimpleNamespace

    from gloo_world import single_process_world
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    cfg = cfg if cfg is not None else VllmConfig(device_config=DeviceConfig(device="cpu"))
    saved = cfg.model_config
    with set_current_vllm_config(cfg), single_process_world(tmp_path_factory.mktemp("dist") / "init"):
        cfg.model_config = SimpleNamespace(model=str(model_dir))
        try:
            yield cfg
        finally:
            cfg.model_config = saved


@pytest.fixture(scope="session")
def cpu_world():
    """`with cpu_world(tmp_path_factory, model_dir) as cfg:` (see `_cpu_world`)."""
    return _cpu_world


def _restore_ple_storage(ng, stock) -> None:
    """Put the release's own PLE storage classes (`stock`: pinned-host, device) back under their
    names in `ng` (nvidia/ngram_embedding) and in every module that imported them, and the layer's
    own forward: a check that applied patch 1 leaves the session as it found it, or a later check's
    "stock" side is patch 1 (run38's order bug hid that way)."""
    from flash_vllm.registry import rebind_stale

    for old, new in zip((ng.Qwen4ExpPLEPinnedHostEmbedding, ng.Qwen4ExpPLEDeviceEmbedding), stock):
        rebind_stale(old, new)
    ng.Qwen4ExpPLEPinnedHostEmbedding, ng.Qwen4ExpPLEDeviceEmbedding = stock
    fwd = ng.Qwen4ExpNGramEmbedding.forward
    if getattr(fwd, "__flash_patch__", None):
        ng.Qwen4ExpNGramEmbedding.forward = fwd.__flash_original__


@pytest.fixture(scope="session")
def restore_ple_storage():
    """`_restore_ple_storage`, for the checks that apply patch 1 in the session's process."""
    return _restore_ple_storage


@pytest.fixture(scope="session")
def snap() -> Path:
    """The QAD export's layout (tests/fakes/ckpt.py `qad`), written by tests/vllm/test_releases.py."""
    raw = os.environ.get("FLASH_TEST_QAD_SNAPSHOT", "")
    assert raw and Path(raw).is_dir(), ("FLASH_TEST_QAD_SNAPSHOT names no snapshot; run through "
                                        "tests/vllm/test_releases.py, which writes the qad fixture")
    return Path(raw)


@pytest.fixture(scope="module")  # the device-type patch lives as long as the module using it, as before
def serve_cli():
    """`vllm serve`'s own argument parser (the `make_arg_parser` its subcommand calls: model_tag,
    --headless, every frontend and engine flag) and the `validate_parsed_serve_args` it runs. The
    subcommand module itself imports uvicorn, which these CPU environments do not carry; the module
    moved between releases; building the CLI instantiates DeviceConfig's "auto", which needs a device
    type this box has none of."""
    import importlib
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for where in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"):  # 0.33 / 0.29-0.32
        try:
            cli_args = importlib.import_module(where)
            break
        except ModuleNotFoundError:
            continue
    else:
        pytest.fail("no vllm serve argument parser module in this release")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(current_platform), "device_type", "cpu", raising=False)
        yield SimpleNamespace(parser=cli_args.make_arg_parser(FlexibleArgumentParser(prog="vllm serve")),
                              validate=cli_args.validate_parsed_serve_args)
