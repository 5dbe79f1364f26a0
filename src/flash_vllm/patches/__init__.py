"""One module per patch; each exposes `PATCH` (a `flash_vllm.registry.Patch`).

Modules import vLLM only inside functions, so the catalogue (docs, `flash patches`, unit tests)
loads without vLLM.
"""
