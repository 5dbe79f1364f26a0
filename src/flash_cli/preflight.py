"""Checks shared by serve, doctor and setup: weights, variants, image base, port.

Each returns a list of Problems instead of raising, so `doctor` can report all of them and
`serve` can raise the first one as a typed error.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path

from . import hfcache
from .errors import ConfigError, FlashError, ImageMissing, PortInUse, WeightsMissing
from .settings import Settings

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
    if mode == "hybrid-mtp" and not model.startswith("RadixArk/"):
        out.append(Problem(ConfigError, f"MODE=hybrid-mtp needs the RadixArk checkpoint, not {model}",
                           "use MODE=hybrid, or MODEL=RadixArk/Qwen3.8-Flash-Next-NVFP4 (profile 'context')"))
    if mode != "nvfp4" and hfcache.quant_method(snapshot) == "compressed-tensors":
        out.append(Problem(ConfigError, f"{model} is a compressed-tensors checkpoint: MODE={mode} cannot prepare it",
                           "serve it as published: flash serve published"))
    if mode != "nvfp4" and not out:
        state = hfcache.variant_state(snapshot, mode)
        if state != "ready":
            what = "graft" if mode == "hybrid-mtp" else "hybrid"
            out.append(Problem(WeightsMissing, f"the {mode} layout {hfcache.variant_dir(snapshot, mode).name} is {state}",
                               f"prepare it: flash setup (or flash prepare {what}); a stale layout is repaired"))
    return out


def ple_mmap_gap(base: str) -> str | None:
    """Why patch 1 (which the run spec always turns on) ships no code for `base`, per the plugin's
    registry (docs/PATCHES.md); None where it does. Without it vLLM puts the table in memory."""
    from flash_vllm.patches.ple_mmap import PATCH  # metadata only: imports no vLLM, no torch

    return None if PATCH.meant_for(base) else PATCH.not_ported.get(base, "no code for this release")


def fp8_kv_gap(base: str) -> str | None:
    """Why fp8 KV on QSA is unavailable on `base` (patch 7 neither ports it nor finds it upstream,
    per the plugin's registry); None where it is served (ported on 0.29/0.30, native from 0.31)."""
    from flash_vllm.patches.qsa_fp8_kv import PATCH  # metadata only: imports no vLLM, no torch

    if PATCH.meant_for(base) or base in PATCH.upstream_in:
        return None
    return PATCH.not_ported.get(base, "no code for this release")


def recipe(s: Settings) -> list[Problem]:
    """Combinations the image cannot serve, caught before a ten-minute boot."""
    out = []
    fp8_gap = fp8_kv_gap(s["BASE"]) if s["KV_DTYPE"] in ("fp8", "fp8_e4m3") else None
    if fp8_gap:
        out.append(Problem(ConfigError, f"KV_DTYPE={s['KV_DTYPE']} is not available on BASE={s['BASE']}: "
                           f"patch 7 (fp8 KV on QSA) is not ported to this release ({fp8_gap})",
                           "use KV_DTYPE=auto, or a base patch 7 serves (see docs/PATCHES.md)"))
    gap = ple_mmap_gap(s["BASE"])
    if gap:
        out.append(Problem(ConfigError, f"BASE={s['BASE']}: patch 1 (PLE table from mmap) is not ported to this release "
                           f"({gap}), so vLLM would put the 48 GiB n-gram table in GPU memory and fail to fit",
                           "use a base patch 1 ships code for (BASE=v0.33, the default profiles); see docs/PATCHES.md"))
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
