"""Checks shared by serve, doctor and setup: weights, variants, image base, port.

Each returns a list of Problems instead of raising, so `doctor` can report all of them and
`serve` can raise the first one as a typed error.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path

from flash_common import releases

from . import hfcache
from .errors import ConfigError, FlashError, ImageMissing, PortInUse, WeightsMissing
from .settings import Settings
from .compile_config import compilation_config, cudagraph_mode
from .spec import LABEL, RunSpec

BASE_LABELS = ("org.flash.base", "qwen38.base")


@dataclass
class Problem:
    error: type[FlashError]
    message: str
    hint: str

    def raise_(self) -> None:
        raise self.error(self.message, hint=self.hint)


def weights(s: Settings, hf_cache: Path, snapshot: Path | None) -> list[Problem]:
    model, mode = s["MODEL"], s["MODE"]
    if snapshot is None:
        return [Problem(WeightsMissing, f"{model} is not in {hf_cache}" + (f" at revision {s['REVISION']}" if s["REVISION"] else ""),
                        "download it: flash setup (or flash download)")]
    missing = hfcache.missing_files(snapshot)
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        return [Problem(WeightsMissing, f"{model} snapshot {snapshot.name[:12]} is incomplete: missing {shown}",
                        "resume the download: flash download (then flash verify)")]
    out: list[Problem] = []
    out += layout_problems(s, snapshot)
    if mode == "hybrid-mtp" and not model.startswith("RadixArk/") and not out:
        out.append(Problem(ConfigError, f"MODE=hybrid-mtp needs the RadixArk checkpoint, not {model}",
                           "use MODE=hybrid, or MODEL=RadixArk/Qwen3.8-Flash-Next-NVFP4 (profile 'context')"))
    if mode != "nvfp4" and hfcache.quant_method(snapshot) == "compressed-tensors":
        out.append(Problem(ConfigError, f"{model} is a compressed-tensors checkpoint: MODE={mode} cannot prepare it",
                           "serve it as published: flash serve published"))
    from .spec import ple_patch_off

    from .checkpoint import known

    fp8_table = getattr(known.layout_of(model, snapshot), "ple_codec", "fp8") == "fp8"  # layout_problems says the rest
    if ple_patch_off(s) and fp8_table and not releases.has(s["BASE"], "ple_fp8_modelopt") \
            and hfcache.quant_method(snapshot) == "modelopt":
        fixed = ", ".join(sorted(releases.where("ple_fp8_modelopt", True)))
        out.append(Problem(ConfigError, f"patch 1 is off (CONTAINER_ENV) and vLLM on BASE={s['BASE']} cannot load {model}'s "
                           "fp8 PLE table without it: its fp8 method is gated on Fp8Config, so a ModelOpt checkpoint gets "
                           "a bf16 table with no weight_scale and the boot fails at load (H200 run40)",
                           f"keep patch 1 on (drop VLLM_PLE_MMAP=0, and 1 from FLASH_DISABLE_PATCHES), or use a base "
                           f"whose stock loader reads it: {fixed}"))
    if mode != "nvfp4" and not out:
        state = hfcache.variant_state(snapshot, mode)
        if state != "ready":
            what = "graft" if mode == "hybrid-mtp" else "hybrid"
            out.append(Problem(WeightsMissing, f"the {mode} layout {hfcache.variant_dir(snapshot, mode).name} is {state}",
                               f"prepare it: flash setup (or flash prepare {what}); a stale layout is repaired"))
    return out


def layout_problems(s: Settings, snapshot: Path | None) -> list[Problem]:
    """What the checkpoint's layout (checkpoint/known.py, read from its index) rules out: a MODE
    it cannot be prepared for, and a base whose vLLM has no method for its PLE table format (patch 1
    decodes NVFP4 tables from disk on top of that method, so neither side serves them there)."""
    from .checkpoint import known
    from .spec import ple_patch_off

    out = parallel_problems(s, snapshot)
    lay = known.layout_of(s["MODEL"], snapshot)
    if lay is None:
        return out
    if s["MODE"] not in lay.modes:
        out.append(Problem(ConfigError, f"MODE={s['MODE']} does not apply to {s['MODEL']} ({lay.what}): "
                           + lay.refused.get(s["MODE"], f"not a layout MODE={s['MODE']} is built from"),
                           f"MODE accepts {' | '.join(lay.modes)} for this checkpoint"))
    stock = lay.stock_table_from is None or s["BASE"] in releases.upstream_from(lay.stock_table_from)
    if not stock:  # with patch 1 on or off: it decodes on top of the release's own table method
        who, on_top = ("vLLM", "") if ple_patch_off(s) else (
            "patch 1", f" (patch 1 decodes it on top of vLLM's own {lay.ple_codec.upper()} table method)")
        out.append(Problem(ConfigError, f"{who} cannot serve {s['MODEL']}'s PLE table ({lay.ple_format}) on "
                           f"BASE={s['BASE']}: vLLM reads that format from {lay.stock_table_from} on{on_top}",
                           f"no serving path on BASE={s['BASE']}, with patch 1 on or off: use BASE={releases.CURRENT}"))
    return out


def parallel_problems(s: Settings, snapshot: Path | None) -> list[Problem]:
    """PARALLEL against the checkpoint's own head counts: the settings check used the published
    geometry (no snapshot then); another checkpoint (a smaller model, a test one) may not split the
    same way, and vLLM would refuse it only after every box has started."""
    from . import geometry, layout

    cfg = snapshot / "config.json" if snapshot is not None else None
    if s["PARALLEL"] == "none" or cfg is None or not cfg.is_file():
        return []
    try:
        g = geometry.from_config(cfg)
    except (OSError, ValueError):
        return []  # the loader names an unreadable config.json itself
    try:
        layout.parse(s["PARALLEL"], g)
    except ConfigError as exc:
        return [Problem(ConfigError, f"{s['MODEL']} ({cfg}): {exc}",
                        f"layouts this checkpoint takes: {' | '.join(layout.accepted(g))}")]
    return []


def served_gap(capability: str, base: str) -> str | None:
    """Why `base` leaves a feature unserved, per the release catalogue (flash_common.releases, which
    the plugin's patches classify themselves by); None where a patch ships code or vLLM has it."""
    if releases.cap(base, capability) is None:
        return f"the release catalogue has {capability}=None for {base}: no code for this release"
    return None


def ple_mmap_gap(base: str) -> str | None:
    """Patch 1, which the run spec always turns on: without it vLLM puts the table in memory."""
    return served_gap("ple_storage", base)


def fp8_kv_gap(base: str) -> str | None:
    """fp8 KV on QSA: patch 7 on some releases, native on later ones."""
    return served_gap("qsa_fp8_kv", base)


PLE_OP_V029 = "vllm::flash_ple_mmap_lookup"  # patch 1's splitting op where ple_storage=splitting-op (p01_ple_mmap.v029.SPLIT_OP)


def last_value(argv: list[str], flag: str) -> str | None:
    """The value argparse keeps for `flag` in argv (`--flag V` or `--flag=V`, the last one wins)."""
    found = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith(flag + "="):
            found = word[len(flag) + 1:]
    return found


def patch1_off(spec: RunSpec) -> bool:
    """Patch 1 turned off in the container's env (VLLM_PLE_MMAP=0, or 1 in FLASH_DISABLE_PATCHES):
    the release's own PLE storage serves, and FULL graphs are vLLM's business again."""
    disabled = {w.strip() for w in spec.env.get("FLASH_DISABLE_PATCHES", "").split(",")}
    return spec.env.get("VLLM_PLE_MMAP", "1").strip().lower() in ("0", "false", "no", "off") or "1" in disabled


def graph_regime(spec: RunSpec) -> list[Problem]:
    """Patch 1's eager mode gathers PLE rows on the host between graph segments: a FULL CUDA graph
    would replay them as a constant (the plugin refuses at capture time, i.e. after the ten-minute
    load). COMPILE_FLAGS replaces flash's default and EXTRA can override it: the argv the RunSpec
    hands vLLM says which wins, so it is read the way vLLM's parser reads it. The hoisted mode
    gathers before the forward, so FULL graphs are legal with it, on the bases the plugin's
    registry serves it on (an explicit hoisted is refused elsewhere; auto falls back to eager there)."""
    base = spec.labels[f"{LABEL}.base"]
    mode_env = spec.env.get("VLLM_PLE_MMAP_MODE", "eager")
    hoisted = mode_env == "hoisted" and releases.has(base, "ple_hoisted")
    out = []
    hoisted_bases = ", ".join(sorted(releases.where("ple_hoisted", True)))
    if mode_env == "hoisted" and not hoisted:
        out.append(Problem(ConfigError, f"PLE_MODE=hoisted is not available on BASE={base} "
                           "(patch 1's hoisted mode is not written for that release's runner)",
                           f"use PLE_MODE=auto or eager, or a base that has it: {hoisted_bases}"))
    argv = spec.command
    if "--enforce-eager" in argv:
        return out
    try:
        cc = compilation_config(argv)
    except ValueError as exc:
        return out + [Problem(ConfigError, f"COMPILE_FLAGS/EXTRA: {exc}", "the value is split with shlex: quote "
                              "the JSON inside it, e.g. COMPILE_FLAGS=\"-cc '{\\\"cudagraph_mode\\\":\\\"PIECEWISE\\\"}'\"")]
    mode = cudagraph_mode(argv, cc)
    if "FULL" in mode and not hoisted and not patch1_off(spec):
        out.append(Problem(ConfigError, f"cudagraph_mode {mode} (from COMPILE_FLAGS/EXTRA) would capture the PLE "
                           "gather in a FULL CUDA graph and replay stale rows; patch 1 needs PIECEWISE (or NONE)",
                           "set cudagraph_mode PIECEWISE in the JSON config, or add -cc.cudagraph_mode=PIECEWISE: dotted "
                           "-cc.* keys replace flash's whole compilation config in vLLM's parser; or gather before "
                           f"the forward (PLE_MODE=auto or hoisted) on {hoisted_bases}"))
    ops = cc.get("splitting_ops")
    if releases.cap(base, "ple_storage") == "splitting-op" and isinstance(ops, list) and PLE_OP_V029 not in ops and mode != "NONE":
        out.append(Problem(ConfigError, f"splitting_ops {ops} (from COMPILE_FLAGS/EXTRA) leaves out patch 1's op "
                           f"{PLE_OP_V029}: on {base} the PLE gather would be captured inside a graph",
                           f"add \"{PLE_OP_V029}\" to splitting_ops, or leave splitting_ops unset"))
    return out


def recipe(spec: RunSpec) -> list[Problem]:
    """Combinations the image cannot serve, caught before a ten-minute boot: checked on the RunSpec
    spec.build made (its vllm argv, container env and base label), so what is checked is what runs.
    A speculative config the base cannot take never gets this far: build() refuses it."""
    base = spec.labels[f"{LABEL}.base"]
    out = graph_regime(spec)
    kv = last_value(spec.command, "--kv-cache-dtype")
    fp8_gap = fp8_kv_gap(base) if kv in ("fp8", "fp8_e4m3") else None
    if fp8_gap:
        out.append(Problem(ConfigError, f"KV_DTYPE={kv} is not available on BASE={base}: "
                           f"patch 7 (fp8 KV on QSA) is not ported to this release ({fp8_gap})",
                           "use KV_DTYPE=auto, or a base patch 7 serves (see docs/PATCHES.md)"))
    gap = ple_mmap_gap(base)
    if gap:
        out.append(Problem(ConfigError, f"BASE={base}: patch 1 (PLE table from mmap) is not ported to this release "
                           f"({gap}), so vLLM would put the 48 GiB n-gram table in GPU memory and fail to fit",
                           f"use a base patch 1 ships code for (BASE={releases.CURRENT}, the default profiles); see docs/PATCHES.md"))
    return out


def image(s: Settings, image_name: str, labels: dict[str, str] | None) -> list[Problem]:
    if labels is None:
        return [Problem(ImageMissing, f"image {image_name!r} is not built", "build it: flash setup")]
    found = next((labels[k] for k in BASE_LABELS if k in labels), None)
    if found != s["BASE"]:
        return [Problem(ImageMissing, f"image {image_name!r} is built for base {found or 'unknown'}, the profile wants {s['BASE']}",
                        f"rebuild: flash setup BASE={s['BASE']} (or choose IMAGE=…)")]
    return []


def port_free(bind: str, port: int) -> bool:
    """True when BIND:PORT can be bound now (connect probes miss listeners on other addresses)."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def port(s: Settings, held_by_us: bool) -> list[Problem]:
    if held_by_us or port_free(s["BIND"], s["PORT"]):
        return []
    return [Problem(PortInUse, f"port {s['BIND']}:{s['PORT']} is already in use by another program",
                    f"pick another: PORT={s['PORT'] + 1}")]
