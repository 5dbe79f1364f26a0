"""The vLLM release catalogue: every supported release, its image and pins, and the capabilities
that differ between releases. One module, read by both wings (the host's settings, run spec,
planner and setup; the plugin's version policy and patch ranges). Imports nothing but stdlib.

Adding a release is one `Release(...)` entry below (`tools/check_vllm_release.py X.Y.Z --propose`
prints it from the release's source) plus the patches that really change. Host code asks
capabilities (`cap`, `has`), never release names; patches declare ranges (`since`,
`upstream_from`, `span`, `where`) that a new entry falls into by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping


class ReleaseError(ValueError):
    """An unknown base, version or capability name (the message lists what is accepted)."""


# Every capability a release entry must state: name -> (accepted values, what it means).
# `None` as a value means "we ship nothing for this on that release" (a gap the host refuses).
CAPS: Mapping[str, tuple[tuple[object, ...], str]] = MappingProxyType({
    "dockerfile": (("Dockerfile", "Dockerfile.v0.29"),
                   "the Dockerfile `flash setup` builds from (BASE_IMAGE is passed when its default differs)"),
    "ple_storage": (("splitting-op", "storage", None),
                    "how patch 1 keeps the PLE gather out of CUDA graphs: a splitting op (0.29) or the "
                    "upstream pinned-host storage class (0.30+); None: not ported"),
    "ple_hoisted": ((True, False),
                    "patch 1's hoisted mode (PLE_MODE=hoisted: rows gathered from the V2 runner's "
                    "Qwen4ExpModelState.prepare_inputs, FULL decode graphs) is written for this release"),
    "ple_fp8_modelopt": ((True, False),
                         "stock vLLM loads a ModelOpt checkpoint's fp8 PLE table (fp8 rows + weight_scale: "
                         "nvidia's and RadixArk's). 0.29 gates its fp8 method on Fp8Config and builds a bf16 "
                         "table with no weight_scale, so there the table loads only through patch 1"),
    "block_size_prefix_groups": ((True, False),
                                 "the engine's cache_config.block_size is the smallest block of the prefix-cacheable "
                                 "KV groups (0.30+). 0.29 takes the smallest of all, the QSA raw-key ring's 8 tokens, "
                                 "so stock seeds and aligns Mamba state at 8: patch 4 corrects it there and changes "
                                 "greedy output (run41), so it is no output-neutral patch on that release"),
    "qsa_fp8_kv": (("patch", "native", None),
                   "fp8 KV cache on QSA layers: patch 7 ships it, vLLM has it, or neither"),
    "reasoning_effort_map": ((True, False),
                             "`vllm serve --reasoning-effort-map` exists (else patch 12 maps efforts)"),
    "mamba_prefill_checkpoints": ((True, False),
                                  "prefix caching aligns hybrid blocks to mamba prefill checkpoints "
                                  "(get_mamba_prefill_checkpoint_alignment; the planner's block size)"),
    "ring_state_bucket": ((True, False),
                          "the KV grouping treats the QSA ring bucket as a state bucket (0.30+; the planner)"),
    "spec_tokens_per_batch_size": ((True, False),
                                   "SpeculativeConfig.num_speculative_tokens_per_batch_size exists "
                                   "(MTP_BY_BATCH: adaptive draft depth)"),
    "spec_eagle_block_drop_flag": ((True, False),
                                   "SpeculativeConfig.disable_eagle_block_drop exists (MTP_BLOCK_DROP=0); "
                                   "0.29's config forbids unknown keys, so the boot would fail"),
    "mtp_hash_lookahead": ((True, False),
                           "with MTP the scheduler hashes one token past each block (num_hash_lookahead_tokens), so "
                           "a prefix-cache hit keeps its last matched block (0.33); without it the drafter drops that "
                           "block (use_eagle_block_drop) unless MTP_BLOCK_DROP=0 (docs/PREFIX-CACHE.md)"),
    "overhead_fitted": ((True, False),
                        "the planner's runtime-overhead constant was fitted on pools measured on this release"),
    "qsa_logits_workspace": (("chunks-128", "chunks-env", "worst-case-env"),
                             "how the QSA indexer's top-k sizes its float32 logits, memory vLLM's profile run never "
                             "sees (plan/workspace.py): chunks of at most 128 MiB (0.29's qsa_select_paged_tokens), "
                             "chunks of at most VLLM_SPARSE_INDEXER_MAX_LOGITS_MB (0.30), or that many MiB allocated "
                             "whole on every prefill (0.31+)"),
    "qsa_topk_site": (("select-paged-tokens", "indexer", None),
                      "where QSA picks its blocks, the hook patches 5 and 8 replace: inline in "
                      "ops/qsa.py's qsa_select_paged_tokens (0.29), or ops/qsa_indexer.py's _topk, whose "
                      "selection is packed with a trailing count (0.30+); None: not ported"),
})


@dataclass(frozen=True)
class Release:
    base: str                     # release line, "v0.33"
    version: str                  # the exact release the Dockerfiles and the vllm tier pin, "0.33.0"
    image: str                    # official image, "vllm/vllm-openai:v0.33.0"
    digest: str | None            # image digest where we know one (None: pinned by tag only)
    torch: str                    # the torch==X the release's wheel pins
    caps: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = sorted(set(CAPS) - set(self.caps))
        unknown = sorted(set(self.caps) - set(CAPS))
        if missing or unknown:
            raise ReleaseError(f"release {self.base}: capabilities missing {missing}, unknown {unknown}; "
                               f"each entry states exactly: {', '.join(CAPS)}")
        for name, value in self.caps.items():
            if value not in CAPS[name][0]:
                raise ReleaseError(f"release {self.base}: {name}={value!r}; accepted: {CAPS[name][0]}")
        object.__setattr__(self, "caps", MappingProxyType(dict(self.caps)))

    @property
    def key(self) -> tuple[int, int, int]:
        return version_key(self.version)


def version_key(version: str) -> tuple[int, int, int]:
    parts = version.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ReleaseError(f"{version!r} is not a release version; expected X.Y.Z, e.g. 0.33.0")
    return int(parts[0]), int(parts[1]), int(parts[2])


def _release(version: str, torch: str, **caps: object) -> Release:
    major, minor, _ = version.split(".")
    return Release(base=f"v{major}.{minor}", version=version, image=f"vllm/vllm-openai:v{version}",
                   digest=None, torch=torch, caps=caps)


_NEWER = dict(dockerfile="Dockerfile", ple_storage="storage", ring_state_bucket=True, overhead_fitted=False,
              spec_tokens_per_batch_size=True, spec_eagle_block_drop_flag=True, ple_hoisted=True,
              ple_fp8_modelopt=True, block_size_prefix_groups=True, qsa_topk_site="indexer",
              qsa_logits_workspace="worst-case-env")

# Oldest first. 0.29.0 is the first release with qwen4_exp.
RELEASES: tuple[Release, ...] = (
    _release("0.29.0", "2.13.0", dockerfile="Dockerfile.v0.29", ple_storage="splitting-op", qsa_fp8_kv="patch",
             reasoning_effort_map=False, mamba_prefill_checkpoints=False, ring_state_bucket=False,
             overhead_fitted=True, spec_tokens_per_batch_size=True, spec_eagle_block_drop_flag=False,
             ple_hoisted=False, ple_fp8_modelopt=False, block_size_prefix_groups=False,
             qsa_topk_site="select-paged-tokens", mtp_hash_lookahead=False, qsa_logits_workspace="chunks-128"),
    _release("0.30.0", "2.13.0", **{**_NEWER, "qsa_logits_workspace": "chunks-env"}, qsa_fp8_kv="patch",
             reasoning_effort_map=False, mamba_prefill_checkpoints=False, mtp_hash_lookahead=False),
    _release("0.31.0", "2.13.0", **_NEWER, qsa_fp8_kv="native", reasoning_effort_map=False,
             mamba_prefill_checkpoints=False, mtp_hash_lookahead=False),
    _release("0.32.0", "2.13.0", **_NEWER, qsa_fp8_kv="native", reasoning_effort_map=False,
             mamba_prefill_checkpoints=False, mtp_hash_lookahead=False),
    _release("0.33.0", "2.14.0", **_NEWER, qsa_fp8_kv="native", reasoning_effort_map=True,
             mamba_prefill_checkpoints=True, mtp_hash_lookahead=True),
)

CURRENT = "v0.33"  # the base the default profiles, the Dockerfile and `flash setup` build on

BY_BASE: Mapping[str, Release] = MappingProxyType({r.base: r for r in RELEASES})
ORDER: tuple[str, ...] = tuple(r.base for r in RELEASES)  # oldest first
NEWEST: str = ORDER[-1]


def _check_catalogue() -> None:
    keys = [r.key for r in RELEASES]
    if keys != sorted(keys) or len(set(ORDER)) != len(ORDER):
        raise ReleaseError(f"RELEASES must be oldest first with one entry per base: {ORDER}")
    if CURRENT not in BY_BASE:
        raise ReleaseError(f"CURRENT={CURRENT!r} is not catalogued; known: {', '.join(ORDER)}")


_check_catalogue()


def get(base: str) -> Release:
    """The catalogue entry of a base ("v0.33"). Unknown -> ReleaseError listing the known ones."""
    try:
        return BY_BASE[base]
    except (KeyError, TypeError):
        raise ReleaseError(f"unknown vLLM base {base!r}; supported: {', '.join(ORDER)}") from None


def by_version(version: str) -> Release:
    for r in RELEASES:
        if r.version == version:
            return r
    raise ReleaseError(f"vLLM {version} is not catalogued; catalogued: {', '.join(r.version for r in RELEASES)}")


def cap(base: str, name: str) -> object:
    """A capability of a base. Unknown base or capability name -> ReleaseError (never KeyError)."""
    release = get(base)
    if name not in CAPS:
        raise ReleaseError(f"unknown release capability {name!r}; known: {', '.join(CAPS)}")
    return release.caps[name]


def has(base: str, name: str) -> bool:
    """A boolean capability (`reasoning_effort_map`, `overhead_fitted`)."""
    value = cap(base, name)
    if not isinstance(value, bool):
        raise ReleaseError(f"capability {name!r} is not a yes/no one (values {CAPS[name][0]}); use cap()")
    return value


# --- ranges, for patch metadata: sets of bases that later catalogue entries fall into -------

def span(first: str, until: str | None = None) -> frozenset[str]:
    """Bases whose release is >= `first` and (if given) < `until` (versions X.Y.Z)."""
    lo, hi = version_key(first), (version_key(until) if until else None)
    return frozenset(r.base for r in RELEASES if r.key >= lo and (hi is None or r.key < hi))


def since(version: str) -> frozenset[str]:
    """Bases from `version` on, including every release catalogued later."""
    return span(version)


def upstream_from(version: str) -> frozenset[str]:
    """Bases where an upstream fix is in (from `version` on): a patch's `upstream_in`."""
    return span(version)


def where(name: str, value: object) -> frozenset[str]:
    """Bases whose capability `name` equals `value` (e.g. where("qsa_fp8_kv", "patch"))."""
    if name not in CAPS:
        raise ReleaseError(f"unknown release capability {name!r}; known: {', '.join(CAPS)}")
    return frozenset(r.base for r in RELEASES if r.caps[name] == value)


def newest_first() -> tuple[str, ...]:
    return tuple(reversed(ORDER))
