"""Patch 12: reasoning-effort aliases for the chat template (v0.29-v0.32).

The Qwen3.8-Flash-Next template accepts `reasoning_effort` xhigh (default), medium and low and
raises on anything else; vLLM passes the request's effort through verbatim, so a client sending
`high` (Claude Code does) gets HTTP 400. The upstream recipe rewrote the template file; we map
the value where every endpoint's template kwargs pass (Chat Completions, Responses, Anthropic
Messages): `renderers/hf.py::resolve_chat_template_kwargs`. The template is never modified, so
every other effort renders byte-identically. v0.33 has `--reasoning-effort-map`, which the run
spec passes instead (same map: `EFFORT_MAP`).
"""

from __future__ import annotations

import json

from flash_common.effort import EFFORT_MAP
from flash_common import releases

from ...registry import UNTRACED_GATE, Context, Gate, Patch, expect_installed, expect_source, install

NUMBER = 12
TARGET = ("vllm.renderers.hf", "resolve_chat_template_kwargs")
# What the run spec passes on v0.33 (kept next to the map so the two cannot drift).
REASONING_EFFORT_MAP_ARG = json.dumps(EFFORT_MAP, separators=(",", ":"))


def _wrap(orig):
    def resolve_chat_template_kwargs(*args, **kwargs):
        resolved = orig(*args, **kwargs)
        effort = resolved.get("reasoning_effort")
        if isinstance(effort, str) and effort in EFFORT_MAP:
            resolved = dict(resolved, reasoning_effort=EFFORT_MAP[effort])
        return resolved

    resolve_chat_template_kwargs.__doc__ = orig.__doc__
    return resolve_chat_template_kwargs


def check(ctx: Context) -> None:
    expect_source(*TARGET, "accept_vars", "return {k: v for k, v in chat_template_kwargs.items()")


def apply(ctx: Context) -> None:
    install(NUMBER, *TARGET, _wrap)


def verify(ctx: Context) -> None:
    expect_installed(NUMBER, *TARGET)


def upstream_check(ctx: Context) -> None:
    expect_source("vllm.renderers.params", "map_reasoning_effort", "effort_map.get(effort, effort)")


PATCH = Patch(
    number=NUMBER,
    name="effort-alias",
    title="Reasoning-effort aliases (high/max -> xhigh, minimal -> low)",
    why=("The model's chat template raises on efforts other than xhigh/medium/low; clients send "
         "high, max or minimal. Mapped in the template kwargs of every endpoint; the template "
         "itself is untouched."),
    upstream="--reasoning-effort-map (in 0.33.0; the run spec passes it there)",
    gate=Gate.flag("FLASH_EFFORT_ALIAS"),
    targets=(":".join(TARGET),),
    applies_to=releases.where("reasoning_effort_map", False),
    upstream_in=releases.where("reasoning_effort_map", True),
    check=check, apply=apply, verify=verify, upstream_check=upstream_check,
    notes=f"v0.33: `--reasoning-effort-map '{REASONING_EFFORT_MAP_ARG}'`.",
    untraced={"FLASH_EFFORT_ALIAS": UNTRACED_GATE + " (and patch 12 rewrites requests, not the model)"},
)
