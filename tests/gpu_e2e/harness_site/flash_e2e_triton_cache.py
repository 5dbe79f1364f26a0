"""One Triton kernel cache for every server of the gpu-e2e fleet (TRITON_CACHE_MANAGER=this:SharedFileCacheManager).

vLLM's InductorAdaptor.initialize_cache sets TRITON_CACHE_DIR inside the engine process to a
directory under its per-config compile cache (0.29 unconditionally; 0.33 unless the caller set one). The fleet gives
every server its own VLLM_CACHE_ROOT, so on 0.29 every server compiled every Triton kernel again: run41
spent 94-117 s in each server's profiling run (0.33's warm boots: ~20 s), ~/.triton/cache stayed empty
and the JIT pack carried nothing to the next session. Triton asks its cache manager class for each
kernel's directory; this one ignores TRITON_CACHE_DIR and uses FLASH_E2E_TRITON_CACHE (default
~/.triton/cache, the directory lab/gpu_session.sh packs). Kernel keys hash the source, the options and
the target, so servers with different patches still get their own kernels, as with Triton's default
cache; writes are per-file atomic in FileCacheManager, so concurrent servers are safe.

Imported by Triton inside the servers (via PYTHONPATH), never by the fleet itself.
"""

from __future__ import annotations

import os

from triton.runtime.cache import FileCacheManager

ENV = "FLASH_E2E_TRITON_CACHE"


def shared_dir() -> str:
    return os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".triton", "cache")


class SharedFileCacheManager(FileCacheManager):
    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override=override, dump=dump)
        if override or dump:  # TRITON_OVERRIDE_DIR / TRITON_DUMP_DIR: a developer's own choice, kept
            return
        self.cache_dir = os.path.join(shared_dir(), self.key)
        self.lock_path = os.path.join(self.cache_dir, "lock")
        os.makedirs(self.cache_dir, exist_ok=True)
