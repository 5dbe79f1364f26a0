"""The command modules. Each exposes `register(subparsers)` and sets `func` on its parser(s).

TABLE is the one command list: adding a command = one module here + a TABLE row for each command
it adds; its register() takes the one-line help from `summary(name)`. `flash X` imports only X's
module: every other command gets a stub parser from TABLE, which is what keeps `flash --help`,
`flash serve --dry-run` and `flash status` fast.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# command → (module, one-line help, aliases), in the order `flash --help` lists them.
TABLE: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "doctor": ("doctor", "check everything serve needs; exit 1 on a problem", ()),
    "setup": ("setup", "build the image, download and prepare the weights (idempotent)", ()),
    "download": ("download", "download the checkpoint into HF_CACHE (resumable; plan with --dry-run)", ()),
    "verify": ("verify", "check the checkpoint: files, headers, index keys; --hash for sha256", ()),
    "prepare": ("prepare", "build the fp8 hybrid (prepare hybrid) or the MTP graft (prepare graft)", ()),
    "serve": ("serve", "start the server for a profile", ("up",)),
    "wait": ("wait", "wait until the server answers /health", ()),
    "test": ("test", "smoke test that gates: exit 1 when a required check fails", ()),
    "monitor": ("monitor", "Prometheus + Grafana + node-exporter next to the server (up|down|status)", ()),
    "probe": ("probe", "greedy probe to JSON; --diff A B exits 1 at the first differing byte", ()),
    "bench": ("bench", "benchmark decode/prefill/TTFT with medians, ABBA, JSONL and plots", ()),
    "status": ("status", "what is running, how it is doing", ()),
    "logs": ("logs", "show the server log", ()),
    "conversations": ("conversations", "follow the request log as conversations (needs LOG_REQUESTS=1)", ()),
    "stop": ("lifecycle", "stop the server (kept; flash start resumes it)", ()),
    "start": ("lifecycle", "start the stopped server container again", ()),
    "rm": ("lifecycle", "remove the server container (caches and keys are kept)", ("down",)),
    "profiles": ("profiles", "list the recipes (profiles/*.env); `show NAME` for one", ()),
    "plan": ("plan", "predict the KV pool, concurrency and host headroom before a boot", ()),
    "patches": ("patches", "the vLLM patch matrix of an image (selfcheck inside it)", ()),
    "service": ("service", "run the recipe as a systemd service at boot (install|status|uninstall)", ()),
}


# the modules, in TABLE's order (a module may hold several commands: lifecycle)
COMMANDS: tuple[str, ...] = tuple(dict.fromkeys(module for module, _, _ in TABLE.values()))


def summary(name: str) -> str:
    """The one-line help of command `name` (what `flash --help` lists)."""
    return TABLE[name][1]


def module_for(word: str | None) -> str | None:
    for name, (module, _, aliases) in TABLE.items():
        if word == name or word in aliases:
            return module
    return None


def load(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")
