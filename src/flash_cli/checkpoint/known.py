"""The checkpoints flash knows, by layout: what to download, which prepare steps apply, what serves.

A layout is recognised from the index (never from file names) by `detect()`; the repo name only
picks the expectation before anything is on disk (`for_model()`). Facts and their sources:
docs/CHECKPOINTS.md ("Checkpoint layouts").

- `nvidia`: nvidia/Qwen3.8-Flash-Next-NVFP4. MIXED_PRECISION: NVFP4 routed experts, BF16 side
  layers, the PLE table as 128 FP8 shards + one BF16 `weight_scale`, FP8-block MTP experts.
- `radixark`: RadixArk/Qwen3.8-Flash-Next-NVFP4. Plain NVFP4: BF16 side layers, 128 FP8 table
  shards, fused BF16 MTP experts (what the graft replaces).
- `qad`: the ModelOpt quantization-aware-distilled export NVIDIA's recipes serve
  (local-inference-lab/Qwen3.8-Flash-Next-NVFP4 and, by its tags, nvidia/Qwen3.8-Flash-Next-FP4-Local):
  MIXED_PRECISION with NVFP4 routed experts, MXFP8 side layers (E4M3 weights + one UE8M0 byte per
  32 values, `weight_scale` U8) and an NVFP4 PLE table: per shard `weight` U8 [rows, 80] (two
  E2M1 values a byte) + `weight_scale` F8_E4M3 [rows, 10] (one per 16), one F32 `weight_scale_2`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

NGRAM = ".ple.ple_embedding.ngram_embedding."
QAD_GLOBAL_SCALE = NGRAM + "weight_scale_2"  # only the NVFP4 table has a second-level scale


@dataclass(frozen=True)
class Layout:
    name: str
    what: str
    # top-level files `flash download` fetches (None: every file of the repo, EXCLUDE aside);
    # sub-folders are never fetched under a pattern list (other formats live there in some repos)
    allow: tuple[str, ...] | None
    # MODE values that serve this layout, and why the others do not (the refusal names it)
    modes: tuple[str, ...]
    refused: dict
    # the table's format as patch 1's engine decodes it from disk: "fp8" rows + a per-tensor
    # scale (flash_vllm.ple.table), or "nvfp4" codes + block scales (flash_vllm.ple.nvfp4)
    ple_codec: str
    ple_format: str
    # the first vLLM release whose own loader reads the table format; None: every base. Patch 1
    # serves an NVFP4 table on top of that release's NVFP4 table method (its parameters, its
    # loader's shard handling), so before it there is no serving path with patch 1 on or off
    stock_table_from: str | None = None
    # what flash serves for this layout that no GPU run has shown yet: `serve` and `doctor` say it
    # (empty once the gpu-e2e tier has booted it)
    unproven: str = ""


SERVING_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
                 "hf_quant_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "vocab.json", "merges.txt", "preprocessor_config.json", "video_preprocessor_config.json",
                 "processor_config.json", "export-manifest.json")

_HYBRID_QAD = ("its side layers are already quantized (MXFP8: E4M3 weights with a UE8M0 scale per 32 values), "
               "so the fp8 hybrid would re-quantize quantized weights; serve it as published (MODE=nvfp4)")
_GRAFT_ONLY_RADIXARK = "the MTP graft replaces RadixArk's fused BF16 draft experts; this checkpoint has none"

LAYOUTS = {
    "nvidia": Layout("nvidia", "nvidia/Qwen3.8-Flash-Next-NVFP4 (MIXED_PRECISION, FP8 PLE table in one file)",
                     None, ("nvfp4", "hybrid"), {"hybrid-mtp": _GRAFT_ONLY_RADIXARK}, "fp8", "FP8 + BF16 scale"),
    "radixark": Layout("radixark", "RadixArk/Qwen3.8-Flash-Next-NVFP4 (plain NVFP4, FP8 PLE table in 10 files)",
                       None, ("nvfp4", "hybrid", "hybrid-mtp"), {}, "fp8", "FP8 + BF16 scale"),
    "qad": Layout("qad", "ModelOpt QAD export (NVFP4 experts, MXFP8 side layers, NVFP4 PLE table)",
                  SERVING_FILES, ("nvfp4",), {"hybrid": _HYBRID_QAD, "hybrid-mtp": _GRAFT_ONLY_RADIXARK},
                  "nvfp4", "NVFP4: U8 codes + F8_E4M3 per-16 scales + F32 weight_scale_2",
                  # vllm/models/qwen4_exp/common/ngram_embedding.py Qwen4ExpPLENvFp4EmbeddingMethod:
                  # in the 0.33.0 wheel, in none of 0.29.0-0.32.0
                  # patch 1's NVFP4 codec booted in a real `vllm serve` and decoded greedy output
                  # byte-identical to vLLM's own table method: gpu-e2e run46 (boot_d, flash_test_d,
                  # ple_nvfp4_d; an H100, fb2c46b), so nothing is left `unproven` for this layout
                  stock_table_from="0.33.0"),
}

# repo (case-insensitive) → layout; an unlisted repo is `detect()`ed once it is on disk
BY_REPO = {
    "nvidia/qwen3.8-flash-next-nvfp4": "nvidia",
    "radixark/qwen3.8-flash-next-nvfp4": "radixark",
    "local-inference-lab/qwen3.8-flash-next-nvfp4": "qad",
    "nvidia/qwen3.8-flash-next-fp4-local": "qad",
}


def for_model(model: str) -> Layout | None:
    name = BY_REPO.get(model.lower())
    return LAYOUTS[name] if name else None


def detect(weight_map: dict[str, str]) -> str | None:
    """The layout an index describes: its PLE table's format and the MTP experts' form."""
    keys = weight_map.keys()
    if any(k.endswith(QAD_GLOBAL_SCALE) for k in keys):
        return "qad"
    if not any(NGRAM + "shard_" in k for k in keys):
        return None
    if any(k.startswith("mtp.layers.0.mlp.experts.gate_up_proj") for k in keys):
        return "radixark"
    if any(k.endswith(NGRAM + "weight_scale") for k in keys):
        return "nvidia"
    return None


def detect_dir(directory: Path) -> str | None:
    from flash_common.stheader import HeaderError, read_index

    try:
        return detect(read_index(directory))
    except HeaderError:
        return None


def layout_of(model: str, snapshot: Path | None) -> Layout | None:
    """What is on disk wins over what the repo name promises."""
    name = detect_dir(snapshot) if snapshot is not None and Path(snapshot).is_dir() else None
    return LAYOUTS[name] if name else for_model(model)


def check_mode(model: str, mode: str, snapshot: Path | None = None) -> Layout | None:
    """Refuse a MODE the checkpoint's layout cannot be prepared for, naming why and what serves."""
    lay = layout_of(model, snapshot)
    if lay is not None and mode not in lay.modes:
        why = lay.refused.get(mode, f"not a layout MODE={mode} is built from")
        raise ConfigError(f"MODE={mode} does not apply to {model} ({lay.what}): {why}",
                          hint=f"MODE accepts {' | '.join(lay.modes)} for this checkpoint")
    return lay


def table_problems(weight_map: dict[str, str]) -> list[str]:
    """An NVFP4 (QAD) PLE table is whole only with a block-scale tensor next to every shard and the
    one global scale: codes without their scales load as garbage, not as an error."""
    if detect(weight_map) != "qad":
        return []
    shards = {k[: -len(".weight")] for k in weight_map if NGRAM + "shard_" in k and k.endswith(".weight")}
    scales = {k[: -len(".weight_scale")] for k in weight_map if NGRAM + "shard_" in k and k.endswith(".weight_scale")}
    out = [f"PLE table: {s}.weight has no {s.rsplit('.', 1)[-1]}.weight_scale (NVFP4 block scales)"
           for s in sorted(shards - scales)[:4]]
    out += [f"PLE table: {s}.weight_scale has no codes ({s.rsplit('.', 1)[-1]}.weight)" for s in sorted(scales - shards)[:4]]
    if not shards:
        out.append("PLE table: an NVFP4 global scale (weight_scale_2) but no shard_<k>.weight codes")
    return out


def allowed(path: str, lay: Layout | None) -> bool:
    """Does `flash download` fetch this repo path for the layout?"""
    if lay is None or lay.allow is None:
        return True
    return "/" not in path and any(fnmatch.fnmatchcase(path, p) for p in lay.allow)
