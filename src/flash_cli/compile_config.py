"""What vLLM's argument parser makes of the compilation flags of an argv: the config it ends up with
and the CUDA graph mode that follows. Read by doctor's graph-regime check (preflight) and by the
planner's capture size (plan/prefill.py); tests/vllm/release/check_compile_flags.py holds it to each
release's own parser."""

from __future__ import annotations

import json

CC_FLAGS = ("--compilation-config", "-cc")


def cudagraph_mode(argv: list[str], cc: dict) -> str:
    """The CUDA graph mode an argv runs with, `cc` its `compilation_config(argv)`: vLLM's default
    when nothing sets it (a COMPILE_FLAGS or dotted -cc.* without a mode) is FULL_AND_PIECEWISE,
    NONE at -O0."""
    level = next((a[2:].lstrip("=") for a in argv if a.startswith("-O") and len(a) > 2), None)
    return str(cc.get("cudagraph_mode", "NONE" if level == "0" else "FULL_AND_PIECEWISE")).upper()


def compilation_config(argv: list[str]) -> dict:
    """The compilation config vLLM's argument parser ends up with for an argv (its semantics,
    FlexibleArgumentParser 0.29-0.33): whole JSON values (`-cc JSON`, `--compilation-config=JSON`)
    and dotted keys (`-cc.KEY=V`, `-cc.KEY V`, `-cc.KEY+=a,b`). Dotted keys of one spelling merge
    into one dict that vLLM appends after every other flag, and the last value of the flag wins
    whole: so one dotted key drops an earlier JSON config entirely (a silent loss we must see)."""
    whole: dict | None = None
    dotted: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        flag = next((f for f in CC_FLAGS if name == f or name.startswith(f + ".")), None)
        if flag is not None:
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            if name == flag:
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError:
                    parsed = None
                if not isinstance(parsed, dict):
                    raise ValueError(f"{flag} {value!r} is not a JSON object")
                whole = parsed
            else:
                key = name[len(flag) + 1:]
                if key.endswith("+"):
                    key, parsed = key[:-1], value.split(",")
                else:
                    try:
                        parsed = json.loads(value)
                    except json.JSONDecodeError:
                        parsed = value
                d = dotted.setdefault(flag, {})
                *parents, leaf = key.split(".")
                for k in parents:
                    d = d.setdefault(k, {})
                d[leaf] = parsed
        i += 1
    if dotted:
        return list(dotted.values())[-1]
    return whole or {}
