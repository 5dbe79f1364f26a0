"""flash_vllm: the recipe's vLLM general plugin (entry point group `vllm.general_plugins`).

Imports vLLM lazily, inside functions only: vLLM merely logs an exception raised while
importing a plugin, so nothing here may fail at import. `register()` is what vLLM calls in
every process (API server, engine core, workers); it applies the enabled patches for this base
and raises when an enabled patch's target is missing. See `flash_vllm.registry` for the patch
units, `flash_vllm.compat` for the base gate and `python -m flash_vllm.selfcheck` for the matrix.
"""


def register() -> None:
    from .metrics_bridge import install, wire
    from .plugin import register as _register

    _register()
    # Metrics bridge (not a vLLM patch, so outside the patch set): every PLEStats of this process
    # publishes through it (injected here), and in the process that serves /metrics it registers
    # the collector that carries the engine's vllm:ple_mmap_* counters there. Never raises.
    # See flash_vllm/metrics_bridge.py.
    wire()
    install()
