"""ISSUE 16 RELEASE FACTS, keyed by base: to move into flash_common.releases (issue 13) at merge.

The one place where issue 16's per-release differences live; host code asks `cap(base, name)`
and never compares release names. Each fact was read in the release's own wheel source
(vllm-X.Y.Z-cp38-abi3-manylinux_2_28_x86_64.whl) and is asserted against the real release by
the vllm tier (tests/vllm/release/check_field_lessons.py):

- `spec_per_batch_size`: `SpeculativeConfig.num_speculative_tokens_per_batch_size`
  (vllm/config/speculative.py; validated by vllm/v1/spec_decode/dynamic/utils.py, read by
  the v1 scheduler's `dynamic_sd_lookup`). Present in 0.29.0 through 0.33.0.
- `spec_disable_eagle_block_drop`: `SpeculativeConfig.disable_eagle_block_drop`. Absent in
  0.29.0 (SpeculativeConfig forbids extra fields, so the boot would fail), present from 0.30.0.
- `default_effort_flag`: how the server's default reasoning effort reaches the chat template:
  `--default-chat-template-kwargs '{"reasoning_effort": ...}'` on every base (the chat,
  responses and Anthropic servings merge it under the request's own kwargs via
  `ChatParams.with_defaults`; a request that sets reasoning_effort wins).
- `effort_map_flag`: the native `--reasoning-effort-map` (0.33.0 only; older bases get the
  aliases from plugin patch 12). Not used by this module's callers yet: spec.py's existing
  check stays until the catalogue lands.
"""

from __future__ import annotations

DEFAULT_CHAT_TEMPLATE_KWARGS = "--default-chat-template-kwargs"

FACTS: dict[str, dict[str, object]] = {
    "v0.29": {"spec_per_batch_size": True, "spec_disable_eagle_block_drop": False,
              "default_effort_flag": DEFAULT_CHAT_TEMPLATE_KWARGS, "effort_map_flag": None},
    "v0.30": {"spec_per_batch_size": True, "spec_disable_eagle_block_drop": True,
              "default_effort_flag": DEFAULT_CHAT_TEMPLATE_KWARGS, "effort_map_flag": None},
    "v0.31": {"spec_per_batch_size": True, "spec_disable_eagle_block_drop": True,
              "default_effort_flag": DEFAULT_CHAT_TEMPLATE_KWARGS, "effort_map_flag": None},
    "v0.32": {"spec_per_batch_size": True, "spec_disable_eagle_block_drop": True,
              "default_effort_flag": DEFAULT_CHAT_TEMPLATE_KWARGS, "effort_map_flag": None},
    "v0.33": {"spec_per_batch_size": True, "spec_disable_eagle_block_drop": True,
              "default_effort_flag": DEFAULT_CHAT_TEMPLATE_KWARGS, "effort_map_flag": "--reasoning-effort-map"},
}


def cap(base: str, name: str):
    """The fact `name` for `base` (KeyError names what is known)."""
    try:
        facts = FACTS[base]
    except KeyError:
        raise KeyError(f"no release facts for base {base!r}; known: {', '.join(FACTS)}") from None
    return facts[name]


def has(base: str, name: str) -> bool:
    return bool(cap(base, name))


def bases_with(name: str) -> list[str]:
    """The bases where `name` holds, oldest first (for error hints)."""
    return [b for b in sorted(FACTS, key=lambda b: tuple(int(x) for x in b[1:].split("."))) if FACTS[b][name]]
