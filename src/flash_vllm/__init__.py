"""flash_vllm: the recipe's vLLM general plugin (entry point group `vllm.general_plugins`).

Imports vLLM lazily, inside functions only. The patch registry, the version gate and the
patches themselves live in submodules; `register()` is what vLLM calls in every process.
"""
