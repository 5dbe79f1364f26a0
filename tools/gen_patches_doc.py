#!/usr/bin/env python3
"""Generate docs/PATCHES.md from the flash_vllm registry and the release catalogue, and stamp the
Dockerfiles: the patch-set hash (`ARG PATCHSET=`, the `org.flash.patchset` label) and the default
release each builds (`ARG BASE_IMAGE=`, `ARG FLASH_VLLM_BASE=`, from flash_common.releases).
`--check` exits 1 on any drift; `--print` writes the doc to stdout and touches nothing."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

# the installed flash_* (the project venv); a PYTHONPATH copy comes first (the release-catalogue
# dry run in tests/unit/test_release_catalogue.py puts one there)
from flash_common import releases
from flash_vllm import compile_key
from flash_vllm.registry import DISABLE_ENV, catalogue, module_of, patchset_hash

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "docs" / "PATCHES.md"
DOCKERFILES = tuple(ROOT / d for d in sorted({str(releases.cap(b, "dockerfile")) for b in releases.ORDER}))
ARG = re.compile(r"^ARG PATCHSET=\S*$", re.M)
BASE_ARG = re.compile(r"^ARG BASE_IMAGE=\S*$", re.M)
LINE_ARG = re.compile(r"^ARG FLASH_VLLM_BASE=\S*$", re.M)

# What adding a vLLM release touches: tests/unit/test_release_files.py counts it on a copy of the
# repository and holds the two numbers and the files named below equal to what it counts.
ADDING = """\
## Adding a vLLM release

One catalogue entry, then the patches that really change:

1. `tools/check_vllm_release.py X.Y.Z --propose` prints the `_release(...)` entry from the release's
   own wheel (torch pin, image, capabilities read from its source); review it and paste it into
   `src/flash_common/releases.py` (move `CURRENT` there too if it becomes the default).
2. Run every generator: `for g in tools/gen_*.py; do python3 "$g"; done`. This page, the
   Dockerfiles' stamps and the settings reference follow (patches declare ranges, so an open range
   takes the new release in; a patch whose ranges leave it unclassified stops the registry from
   loading, naming the patch).
3. `tests/run vllm`: the tier reads its release list from the catalogue, so it sets up and checks
   the new release with the others (`tools/check_vllm_release.py X.Y.Z` checks it alone). Every
   patch that applies must still fit; only a patch that breaks needs code. The release checks ask
   the catalogue for capabilities, never for release names, so they follow too.

Files a real addition touches: **5**: `src/flash_common/releases.py` (by hand) and, regenerated,
`docs/PATCHES.md`, `docs/SETTINGS.md`, `Dockerfile` and `Dockerfile.v0.29` (the patch-set stamp
covers the catalogue); plus the patches that really change.

Making it the current base too (`CURRENT`, in the same file) changes what names the current base:
**32** files: the 5 above, `docs/PLAN.md` (its profile table) and the 26 golden run specs
(`FLASH_UPDATE_GOLDEN=1`: image tag and base label). Profiles say `# base: current` and follow.

`tests/unit/test_release_files.py` counts both on a copy of the repository (the catalogue entry,
every generator, the golden tests) and fails when this section names other files or numbers.
Before the catalogue it was about 30 files, found by grep.
"""


def compile_key_section() -> list[str]:
    """The compile-cache key (flash_vllm/compile_key.py): not a numbered patch, always on."""
    traced = "; ".join(f"patch {n}: " + ", ".join(f"`{v}`" for v in names)
                       for n, names in sorted(compile_key.traced().items()))
    lines = [
        "## The compile-cache key (always on, not a numbered patch)",
        "",
        "vLLM keys its compile caches (the AOT artifact, on by default with torch >= 2.10 on every release",
        "above; the Inductor cache directory) on `VllmConfig.compute_hash()` and on the *known* vLLM",
        "variables only, and an AOT load checks only that the traced files' contents are unchanged. Our",
        "patches are switched by variables vLLM does not know, so with a persistent cache (`COMPILE_CACHE`,",
        "the `flash-compile` volume) two boots that differed only in their patches got the same key, and",
        "the second loaded the graph traced with the first one's code. It bites where the model is",
        "compiled: 0.29, whose qwen4_exp nvidia model and MTP heads are `@support_torch_compile`; 0.30-0.33",
        "run it with breakable CUDA graphs (CompilationMode.NONE), where the key changes nothing but the",
        "cache directory names.",
        "",
        f"`register()` therefore wraps `{':'.join(compile_key.TARGET)}` (after the patches, in every",
        "vLLM process) and mixes vLLM's hash with the flash key: the sha256 of the base, the applied patch",
        "numbers, each applied patch's traced-code knobs (normalised: unset and the default are one state),",
        "and a hash of the plugin's own source (`flash_vllm/**/*.py`, `flash_common/*.py`). One boot line",
        "names it: `flash_vllm: compile-cache key <16 hex> (… patches [..], traced knobs {..}, plugin",
        "source <16 hex>)`. `FLASH_DISABLE_PATCHES` cannot switch it off.",
        "",
        f"- traced knobs: {traced}.",
        "- left out on purpose (a boot that moves them must not recompile):",
    ]
    lines += [f"  - `{v}`: {cell(why)}" for v, why in sorted(compile_key.untraced().items())]
    lines += ["", "Each patch declares both on itself (`traced`, with `knobs()`, and `untraced`, with the "
              "reason); the unit tier fails when a patch's folder reads a variable its Patch declares in neither "
              "(`tests/unit/test_compile_key.py`); `tests/vllm/release/check_compile_key.py` shows on each "
              "release that vLLM's own `aot_compile_hash_factors` cannot tell two patch states apart and "
              "tells them apart with the key."]
    return lines


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    bases = releases.ORDER
    lines = [
        "# flash_vllm patches",
        "",
        "<!-- generated by tools/gen_patches_doc.py from src/flash_vllm/registry.py; do not edit -->",
        "",
        f"Patch set `{patchset_hash()}` (the images' `org.flash.patchset` label). Every patch is a folder",
        "`src/flash_vllm/patches/pNN_name/` (its `PATCH`, helpers and per-release variants; the registry",
        "finds the folders), applied at runtime by `flash_vllm.register()` (vLLM's",
        "`vllm.general_plugins` entry point) in every vLLM process; nothing in vLLM is rewritten on disk.",
        "An enabled patch whose target is missing stops the process at boot, naming the patch.",
        f"`{DISABLE_ENV}=4,12` switches patches off by number (an operator's kill switch).",
        "",
        "Status per release, as `tools/check_vllm_release.py X.Y.Z` and the vllm test tier verify it on",
        "the real wheels: **applies** (we ship code; it applies, is idempotent and rebinds its targets),",
        "**upstream** (the release has the fix; read from its source), **not-needed**, **not-ported**",
        "(no code for that release, reason given; the run spec must not ask for the feature).",
        "",
        "| # | patch | gate | " + " | ".join(f"{b} ({releases.get(b).version})" for b in bases) + " |",
        "|---|---|---|" + "---|" * len(bases),
    ]
    for p in catalogue():
        row = [str(p.number), f"[{p.name}](#{p.number}-{p.name}) {cell(p.title)}", f"`{cell(p.gate.doc)}`"]
        row += [p.expected_status(b) for b in bases]
        lines.append("| " + " | ".join(row) + " |")
    for p in catalogue():
        lines += ["", f"## {p.number} {p.name}", "", f"**{p.title}.** {cell(p.why)}", ""]
        lines.append(f"- gate: `{cell(p.gate.doc)}`" + (f" (env `{p.gate.env}`)" if p.gate.env else ""))
        lines.append(f"- upstream: {cell(p.upstream)}")
        lines.append("- targets: " + ", ".join(f"`{t}`" for t in p.targets))
        lines.append(f"- code: `src/flash_vllm/patches/{p.folder}/`")
        if p.traced:
            lines.append("- compile key: traces " + ", ".join(f"`{v}`" for v in p.traced))
        if p.applies_to:
            lines.append("- ships code for: " + ", ".join(b for b in bases if b in p.applies_to))
        if p.upstream_in:
            lines.append("- upstream in: " + ", ".join(b for b in bases if b in p.upstream_in))
        for b, why in p.not_ported.items():
            lines.append(f"- not ported to {b}: {cell(why)}")
        if p.notes:
            lines.append(f"- notes: {cell(p.notes)}")
        doc = (module_of(p).__doc__ or "").strip().splitlines()
        body = [ln.rstrip() for ln in doc[1:]]
        while body and not body[0]:
            body.pop(0)
        if body:
            lines += ["", *body]
    lines += ["", *compile_key_section(), "", ADDING]
    return "\n".join(lines).rstrip() + "\n"


def default_release(dockerfile: str) -> releases.Release:
    """The release a Dockerfile builds without build args: the current base where that is its
    Dockerfile, else the newest release it serves."""
    served = [b for b in releases.ORDER if releases.cap(b, "dockerfile") == dockerfile]
    return releases.get(releases.CURRENT if releases.CURRENT in served else served[-1])


def stamped(path: Path) -> str:
    text = path.read_text()
    for pattern in (ARG, BASE_ARG, LINE_ARG):
        if not pattern.search(text):
            raise SystemExit(f"{path.name} has no `{pattern.pattern[1:-5]}` line")
    release = default_release(path.name)
    text = BASE_ARG.sub(f"ARG BASE_IMAGE={release.image}" + (f"@{release.digest}" if release.digest else ""), text)
    text = LINE_ARG.sub(f"ARG FLASH_VLLM_BASE={release.base}", text)
    return ARG.sub(f"ARG PATCHSET={patchset_hash()}", text)


def write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if the doc or a Dockerfile is stale")
    ap.add_argument("--print", action="store_true", help="write docs/PATCHES.md's text to stdout; touch nothing")
    args = ap.parse_args()
    if args.print:
        sys.stdout.write(render())
        return 0
    wanted = {OUT: render(), **{d: stamped(d) for d in DOCKERFILES}}
    stale = [p for p, text in wanted.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is out of date: run tools/gen_patches_doc.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        write(p, wanted[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
