"""lab/bench_profile.py and lab/decode/trace.py against each release's profiler (CPU): the
`--profiler-config` the bench appends parses with `vllm serve`'s own parser into the values it
means; a trace written by the release's own TorchProfilerWrapper, around steps annotated by the
release's own Worker.annotate_profile, reads back as the steps and classes that ran; and the
/start_profile body the bench posts (a prefix, a step bound) is one the release takes, 0.32 on
(the bench names that floor)."""

from __future__ import annotations

import ast
import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab import bench_profile as bp  # the repository root is on sys.path (`python -m pytest` from it)
from lab.decode import trace


def _release() -> tuple[int, int]:
    import vllm

    return tuple(int(x) for x in vllm.__version__.split(".")[:2])


def _src(rel: str) -> Path:
    spec = importlib.util.find_spec("vllm")
    return Path(next(iter(spec.submodule_search_locations))) / rel


def test_the_profiler_flag_parses_into_what_the_bench_means(serve_cli, tmp_path):
    from vllm.config import ProfilerConfig

    args = serve_cli.parser.parse_args(["m", "--profiler-config", bp.profiler_config(tmp_path)])
    pc = args.profiler_config
    pc = pc if isinstance(pc, ProfilerConfig) else ProfilerConfig(**pc)
    assert (pc.profiler, pc.torch_profiler_dir) == ("torch", str(tmp_path.resolve()))
    assert pc.torch_profiler_with_stack is False and pc.ignore_frontend is True and pc.torch_profiler_use_gzip is True
    # the config is strict: a key the release does not know is refused, not ignored
    with pytest.raises(Exception, match="torch_profiler_with_stacks"):
        ProfilerConfig(**{**json.loads(bp.profiler_config(tmp_path)), "torch_profiler_with_stacks": False})


def test_a_trace_the_release_writes_reads_back_as_its_steps(tmp_path, monkeypatch):
    import torch
    import vllm.v1.utils as vutils
    from vllm.config import ProfilerConfig
    from vllm.profiler.wrapper import TorchProfilerWrapper
    from vllm.v1.worker.gpu_worker import Worker

    # the bench's env: the model runner's sections recorded (the choice is made once and kept)
    for k, v in bp.SCOPES.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(vutils, "_PROFILER_FUNC", None)

    cfg = ProfilerConfig(profiler="torch", torch_profiler_dir=str(tmp_path), torch_profiler_with_stack=False,
                         ignore_frontend=True, max_iterations=6)
    wrapper = TorchProfilerWrapper(cfg, worker_name="mixed-8192_dp0_pp0_tp0_rank0", local_rank=0, activities=["CPU"])
    worker = SimpleNamespace(profiler=wrapper, vllm_config=SimpleNamespace(profiler_config=cfg))
    since = time.time()
    wrapper.start()
    x = torch.randn(64, 64)
    for i in range(9):  # 3 steps of a stream alone, then a 25-token piece beside it; the bound stops it at 6
        piece = i >= 3
        so = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="p")] if piece else [],
                             num_scheduled_tokens={"s": 3, **({"p": 25} if piece else {})},
                             scheduled_cached_reqs=SimpleNamespace(is_context_phase=lambda rid: False),
                             scheduled_encoder_input_stats=None)
        with Worker.annotate_profile(worker, so):
            with vutils.record_function_or_nullcontext("gpu_model_runner: forward"):
                for _ in range(2 + 6 * piece):
                    x = torch.tanh(x @ x)
        with vutils.record_function_or_nullcontext("gpu_model_runner: sample"):  # sample_tokens: after the annotation
            x = torch.tanh(x)
    if wrapper._running:  # a release whose bound is checked at the next step's start
        wrapper.stop()
    path = bp.find_trace(tmp_path, "mixed-8192", since, timeout=30)
    s = trace.summarize(path)
    alone, mixed = "execute_context_0(0)_generation_1(3)", "execute_context_1(25)_generation_1(3)"
    assert set(s["classes"]) == {alone, mixed}, s["classes"].keys()
    assert s["steps"] == 6 and s["classes"][alone]["steps"] == 3 and s["classes"][mixed]["steps"] == 3
    c = s["classes"][mixed]
    assert c["period_ms"] > 0 and c["gpu_events"] == 0  # CPU only: no GPU events, none invented
    assert "aten::matmul" in c["top_host_ops"] and c["top_host_ops"]["aten::matmul"] > 0
    assert set(c["sections"]) == {"gpu_model_runner: forward", "gpu_model_runner: sample"}, c["sections"]
    assert c["sections"]["gpu_model_runner: forward"] > c["sections"]["gpu_model_runner: sample"] > 0


def test_the_start_body_is_one_the_release_takes_from_0_32():
    tree = ast.parse(_src("entrypoints/serve/profile/api_router.py").read_text()) \
        if _src("entrypoints/serve/profile/api_router.py").exists() else None
    fields = set()
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.ClassDef) and node.name == "StartProfileRequest":
            fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)}
    if _release() >= (0, 32):
        from vllm.config.profiler import validate_profile_iteration_bounds, validate_profile_prefix

        assert {"profile_prefix", "max_iterations"} <= fields, fields
        for kind, n in bp.parse_scenarios(bp.DEFAULT_SCENARIOS):
            assert validate_profile_prefix(f"{kind}-{n}") == f"{kind}-{n}"
        validate_profile_iteration_bounds(None, bp.STEPS)
    else:  # the bench's docstring names 0.32 as its floor: here the body's fields would be ignored
        assert "max_iterations" not in fields
