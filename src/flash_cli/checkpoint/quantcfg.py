"""The hybrid's quant-config edit: the converted side layers become FP8_PB_WO under MIXED_PRECISION.

docs/decisions/hybrid-convention.md. vLLM's ModelOpt MIXED_PRECISION config (patch 6 relies on
it, no dispatch shim ships) serves a layer as FP8_PB_WO only when (1) `quantized_layers` has
`{"quant_algo": "FP8_PB_WO", "group_size": 128}` for it (fused modules: for every shard) and
(2) no `ignore`/`exclude_modules` pattern matches it (fnmatch or substring, as vLLM does), since an excluded layer stays excluded even
when listed. So: plain NVFP4 configs (RadixArk) become MIXED_PRECISION with their experts listed
as NVFP4; every exclude pattern that matches a converted module (by its checkpoint name, its
vLLM name, or its fused vLLM name) is dropped. Unlisted layers stay unquantized in
MIXED_PRECISION, so dropping e.g. `*.linear_attn.*` leaves in_proj_a/b in BF16 as before.
"""

from __future__ import annotations

import fnmatch
import re

from .layout import CheckpointError

FP8_PB_WO = {"quant_algo": "FP8_PB_WO", "group_size": 128}
EXCLUDE_KEYS = ("ignore", "exclude_modules")
_EXPERTS = re.compile(r"(model\.language_model\.layers\.\d+\.mlp\.experts)\.\d+\.")
# vLLM's fused modules (packed_modules_mapping): a pattern naming the fused module excludes its shards
_FUSED = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz", "q_proj": "qkv_proj", "k_proj": "qkv_proj",
          "v_proj": "qkv_proj", "index_qk_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def expert_prefixes(weight_map: dict) -> list[str]:
    """`model.language_model.layers.L.mlp.experts` for every layer with per-expert tensors."""
    return sorted({m.group(1) for k in weight_map if (m := _EXPERTS.match(k))})


def _names(module: str) -> list[str]:
    """A converted module as the exclude matcher may see it: checkpoint, vLLM and fused vLLM names."""
    out = [module, module.replace("model.language_model.", "model.", 1)]
    base, _, leaf = module.rpartition(".")
    if base.endswith(".indexer"):  # 0.32+: self_attn.indexer.index_qk_proj is a shard of self_attn.qkv_proj
        base = base[: -len(".indexer")]
    if leaf in _FUSED:
        fused = f"{base}.{_FUSED[leaf]}"
        out += [fused, fused.replace("model.language_model.", "model.", 1)]
    return out


def _matches(name: str, pat: str) -> bool:
    """vLLM's `is_layer_excluded`: substring (older ModelOpt exports) or fnmatch."""
    return pat in name or fnmatch.fnmatchcase(name, pat)


def _group_size(q: dict) -> int:
    gs = q.get("group_size")
    if gs is None:
        gs = (((q.get("config_groups") or {}).get("group_0") or {}).get("weights") or {}).get("group_size")
    return int(gs or 16)


def to_mixed(q: dict, modules: list[str], experts: list[str], where: str) -> list[str]:
    """Edit one quant-config dict in place (the flat config.json form or hf_quant_config's
    `quantization`). Returns the exclude patterns it dropped."""
    algo = str(q.get("quant_algo", "")).upper()
    if algo == "NVFP4":
        if not experts:
            raise CheckpointError(f"{where}: NVFP4 config but no per-expert tensors in the index")
        q["quant_algo"] = "MIXED_PRECISION"
        gs = _group_size(q)
        q["quantized_layers"] = {e: {"quant_algo": "NVFP4", "group_size": gs} for e in experts}
    elif algo != "MIXED_PRECISION" or not isinstance(q.get("quantized_layers"), dict):
        raise CheckpointError(f"{where}: quant_algo {q.get('quant_algo')!r}; the hybrid is made from NVFP4 or "
                              "MIXED_PRECISION (with quantized_layers) ModelOpt exports")
    layers = q["quantized_layers"]
    for m in modules:
        have = layers.get(m)
        if have is not None and str(have.get("quant_algo", "")).upper() != "FP8_PB_WO":
            raise CheckpointError(f"{where}: quantized_layers already lists {m} as {have.get('quant_algo')}")
        layers[m] = dict(FP8_PB_WO)
    names = [n for m in modules for n in _names(m)]
    dropped: list[str] = []
    for key in EXCLUDE_KEYS:
        lst = q.get(key)
        if not isinstance(lst, list):
            continue
        keep = []
        for pat in lst:
            if isinstance(pat, str) and any(_matches(n, pat) for n in names):
                dropped.append(pat)
            else:
                keep.append(pat)
        q[key] = keep
    return dropped


def edit(cfg: dict, hq: dict | None, modules: list[str], experts: list[str]) -> dict:
    """Both configs in place; returns a summary for the marker. Exclude lists that were identical stay so."""
    targets = []
    if isinstance(cfg.get("quantization_config"), dict):
        targets.append(("config.json quantization_config", cfg["quantization_config"]))
    tq = (cfg.get("text_config") or {}).get("quantization_config")
    if isinstance(tq, dict):
        targets.append(("config.json text_config.quantization_config", tq))
    if hq is not None:
        if not isinstance(hq.get("quantization"), dict):
            raise CheckpointError("hf_quant_config.json has no quantization object")
        targets.append(("hf_quant_config.json quantization", hq["quantization"]))
    if not targets:
        raise CheckpointError("config.json has no quantization_config; the hybrid is made from the ModelOpt exports")
    before = [tuple(map(str, q.get(k) or [])) for _, q in targets for k in EXCLUDE_KEYS if q.get(k)]
    dropped = {where: to_mixed(q, modules, experts, where) for where, q in targets}
    after = [tuple(map(str, q.get(k) or [])) for _, q in targets for k in EXCLUDE_KEYS if q.get(k)]
    if len(set(before)) == 1 and len(set(after)) > 1:
        raise CheckpointError("the exclude lists were identical and no longer are after the edit")
    return {"quant_algo": "MIXED_PRECISION", "fp8_pb_wo_layers": len(modules), "nvfp4_experts": len(experts),
            "excludes_dropped": sorted({p for ps in dropped.values() for p in ps})}


def problems(cfg: dict, hq: dict | None, modules: list[str]) -> list[str]:
    """The static gate: every converted module is FP8_PB_WO in every quant config and excluded by none."""
    out = []
    qs = [("config.json", cfg.get("quantization_config")),
          ("config.json text_config", (cfg.get("text_config") or {}).get("quantization_config"))]
    if hq is not None:
        qs.append(("hf_quant_config.json", hq.get("quantization")))
    qs = [(w, q) for w, q in qs if isinstance(q, dict)]
    if not qs:
        return ["no quantization config"]
    for where, q in qs:
        if str(q.get("quant_algo", "")).upper() != "MIXED_PRECISION":
            out.append(f"{where}: quant_algo is {q.get('quant_algo')!r}, not MIXED_PRECISION")
            continue
        layers = q.get("quantized_layers") or {}
        excl = [p for k in EXCLUDE_KEYS for p in (q.get(k) or []) if isinstance(p, str)]
        for m in modules:
            if (layers.get(m) or {}).get("quant_algo") != "FP8_PB_WO":
                out.append(f"{where}: {m} is not FP8_PB_WO in quantized_layers")
            hit = next((p for p in excl for n in _names(m) if _matches(n, p)), None)
            if hit is not None:
                out.append(f"{where}: {m} matches exclude pattern {hit!r} (vLLM would leave it unquantized)")
    return out
