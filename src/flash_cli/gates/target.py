"""Which server a gate talks to: `--url`, else the running flash container found by label,
else 127.0.0.1:PORT from the settings. API keys come from a file or the environment, never argv."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import FlashError, UsageError


@dataclass
class Target:
    url: str
    key: str | None
    model: str  # expected model id ('' = take the first one the server lists)
    source: str  # how it was found, for the header line
    ple: bool | None = None  # the container runs the PLE mmap patch with its counters on (None: unknown)
    recipe: object = None  # the Settings the server should run (container labels, or the words given)
    recipe_source: str = ""  # where `recipe` came from, for the context check's line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:18300 (default: the running container)")
    p.add_argument("--model", help="expected model id (default: the container's served name, else the first listed)")
    p.add_argument("--api-key-file", type=Path,
                   help="file holding the API key (default: $VLLM_API_KEY, else the container's key file)")


def _read_key(path: Path) -> str:
    try:
        key = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UsageError(f"cannot read --api-key-file {path}: {exc.strerror}") from None
    if not key:
        raise UsageError(f"--api-key-file {path} is empty")
    return key


def resolve(args: argparse.Namespace, recipe) -> Target:
    key = _read_key(args.api_key_file) if getattr(args, "api_key_file", None) else os.environ.get("VLLM_API_KEY") or None
    model = getattr(args, "model", None) or ""
    if getattr(args, "url", None):
        url = args.url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--url {args.url!r} is not an http(s) URL", hint="e.g. --url http://127.0.0.1:18300")
        given = recipe_given(args)
        return Target(url, key, model, "", recipe=recipe.settings if given else None,
                      recipe_source=f"the recipe given ({' '.join(args.recipe)})" if given else "")
    name = recipe.settings["NAME"]
    try:
        from .. import engine, running

        container = engine.find(engine.connect(timeout=10), name)
    except FlashError:
        container = None
    if container is not None:
        ep = running.endpoint(container)
        env = dict(e.partition("=")[::2] for e in (container.attrs.get("Config") or {}).get("Env") or [])
        ple = env.get("VLLM_PLE_MMAP") == "1" and env.get("VLLM_PLE_MMAP_PROMETHEUS", "1") != "0"
        labelled = running.recipe_settings(container.labels)
        return Target(ep.url, key or ep.key, model or ep.model, f"container {name}", ple, recipe=labelled,
                      recipe_source=f"container {name}'s labels" if labelled is not None else "")
    from .. import state

    url = f"http://127.0.0.1:{recipe.settings['PORT']}"
    given = recipe_given(args)
    return Target(url, key or state.read_api_key(name), model, f"no container {name!r} found; trying PORT",
                  recipe=recipe.settings if given else None,
                  recipe_source=f"the recipe given ({' '.join(args.recipe)})" if given else "")


GATE_PREFIXES = ("TEST_", "BENCH_")


def recipe_given(args: argparse.Namespace) -> bool:
    """Whether the command line names a recipe to compare the server with: a profile, or a
    setting that is not one of the gate's own thresholds (`flash test TEST_MIN_DECODE_TPS=5
    --url …` tunes the gate, it does not say what the server runs)."""
    from ..recipe import split_words

    words = list(getattr(args, "recipe", None) or [])
    _, rest, named = split_words(words)
    return named or any(not w.partition("=")[0].startswith(GATE_PREFIXES) for w in rest)


def client(target: Target, recipe):
    from .client import Client

    return Client(target.url, target.key, timeout=recipe.settings["TEST_TIMEOUT"])
