"""gpu-e2e's fault injection, loaded at interpreter start of every process of a `guard-p3*` server.

With FLASH_E2E_INJECT=mamba-copy on the environment (and this directory first on PYTHONPATH, both set
by fleet.render for servers with Server.inject), a post-import hook installs
flash_e2e_mamba_inject.install on vllm.v1.worker.mamba_utils as soon as that module is executed
(the engine's worker imports it; the API server never does). Anything else: nothing happens. A
refusal (the release moved what the injection relies on) is printed, not raised: the boot goes on and
the scenario fails on the missing `ready` line with the reason. Any other sitecustomize later on
sys.path still runs.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

# harness_site (every server has it on PYTHONPATH; a test that runs this file alone may not)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "harness_site"))
import flash_e2e_site  # noqa: E402


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, then):
        self.module, self.then = module, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        spec = flash_e2e_site.next_spec(self, fullname, path, target)
        if spec is None:
            return None
        loader, then = spec.loader, self.then
        real_exec = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                real_exec(module)
                then(module)

        spec.loader = _Loader()
        return spec


def _install() -> None:
    if os.environ.get("FLASH_E2E_INJECT") != "mamba-copy":
        return
    import flash_e2e_mamba_inject as inj

    def then(module):
        try:
            inj.install(module)
        except inj.Refused as exc:
            inj.say("refused", str(exc))

    sys.meta_path.insert(0, _AfterImport(inj.TARGET_MODULE, then))


_install()
flash_e2e_site.chain_next(__file__)  # harness_site: the next sitecustomize on sys.path still runs
