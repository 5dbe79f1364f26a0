"""One process's vLLM distributed state on CPU, for building a release's layers outside a server.

Layers ask `parallel_state` for their TP/PP groups at init, so every check that builds one needs a
world: gloo, one rank, model-parallel groups of one. Shared by conftest's `cpu_world` (which adds a
current VllmConfig), the checks that need only the groups, and encoder_peak.py (a subprocess
without pytest).
"""

from __future__ import annotations

import contextlib
from pathlib import Path


@contextlib.contextmanager
def single_process_world(store: Path):
    """World size 1 over gloo, TP = PP = 1; destroyed on exit. `store` is the path gloo's file
    store creates: a name inside a directory private to the caller (a guessed name in a shared
    directory could join another run's world or find a stale file)."""
    from vllm.distributed import parallel_state as ps

    ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{store}",
                                    local_rank=0, backend="gloo")
    try:
        ps.initialize_model_parallel(1, 1)
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
