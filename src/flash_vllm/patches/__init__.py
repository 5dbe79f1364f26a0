"""One folder per numbered patch, `pNN_name/` (NN the number, name the patch's name with `_` for
`-`): its package exposes `PATCH` (a `flash_vllm.registry.Patch`, which also declares what the
patch hands the compile-cache key); its other modules are the patch's helpers and per-release
variants. `registry.catalogue()` finds the folders; nothing lists them.

Modules import vLLM only inside functions, so the catalogue (docs, `flash patches`, unit tests)
loads without vLLM.
"""
