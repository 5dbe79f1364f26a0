"""gpu-e2e's broken-patch boot: move one anchor in a copy of a vLLM module, the way an upstream edit would.

With FLASH_E2E_BREAK='{"module": M, "old": A, "new": B}' on the environment (and this directory
first on PYTHONPATH), module M is loaded from a copy of its source with A replaced by B, written
under FLASH_E2E_BREAK_DIR, so the code runs the same but `inspect.getsource` (what our patches'
anchor checks read) sees the moved anchor. Every process of the server (API server, engine core,
workers) inherits it. Any other sitecustomize later on sys.path still runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

# harness_site (every server has it on PYTHONPATH; a test that runs this file alone may not)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "harness_site"))
import flash_e2e_site  # noqa: E402


class _MovedAnchor(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, module: str, old: str, new: str, where: str):
        self.module, self.old, self.new, self.where = module, old, new, where

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        spec = flash_e2e_site.next_spec(self, fullname, path, target)
        if spec is None:
            return None
        if not spec.origin or not spec.origin.endswith(".py"):
            raise ImportError(f"FLASH_E2E_BREAK: {fullname} has no Python source ({spec.origin})")
        self.origin = spec.origin
        return importlib.util.spec_from_file_location(fullname, self._copy(), loader=self)

    def _copy(self) -> str:
        with open(self.origin, encoding="utf-8") as fh:
            src = fh.read()
        if self.old not in src:
            raise ImportError(f"FLASH_E2E_BREAK: {self.old!r} not in {self.origin}; nothing to move")
        os.makedirs(self.where, exist_ok=True)
        self.copy = os.path.join(self.where, self.module.replace(".", "_") + ".py")
        tmp = f"{self.copy}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(src.replace(self.old, self.new))
        os.replace(tmp, self.copy)
        return self.copy

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(self.copy, encoding="utf-8") as fh:
            code = compile(fh.read(), self.copy, "exec")
        module.__package__ = self.module.rpartition(".")[0]
        exec(code, module.__dict__)  # noqa: S102 - the release's own source, one anchor moved
        print(f"FLASH_E2E_BREAK applied: {self.module} loaded from {self.copy} "
              f"({self.old!r} -> {self.new!r})", file=sys.stderr, flush=True)


def _install() -> None:
    raw = os.environ.get("FLASH_E2E_BREAK")
    if not raw:
        return
    spec = json.loads(raw)
    where = os.environ.get("FLASH_E2E_BREAK_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "flash-e2e-break")
    sys.meta_path.insert(0, _MovedAnchor(spec["module"], spec["old"], spec["new"], where))


_install()
flash_e2e_site.chain_next(__file__)  # harness_site: the next sitecustomize on sys.path still runs
