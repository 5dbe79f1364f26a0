"""GPU-resident weights by component: from the checkpoint's safetensors headers when the snapshot
(or its prepared variant) is on disk, from the known geometry otherwise.

Components (bytes as stored; vLLM keeps NVFP4, fp8 and bf16 tensors at their checkpoint width):
routed experts (NVFP4: packed U8 + F8 group scales + 2 F32 scalars), side layers (the 312 dense
projections `prepare hybrid` converts: bf16, or fp8 + F32 [N/128, K/128] scales), embeddings and
lm_head, hyper-connections, other dense (routers, norms, GDN a/b/conv, indexer norms), PLE
projections, the vision tower, the MTP drafter (experts bf16 / fp8 / NVFP4 by checkpoint and
mode, plus its dense part), the reduced draft-head copy, and the PLE table (0 on the GPU: the
plugin serves it from the mmapped checkpoint).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..geometry import Geometry

GIB = 1024**3
DRAFT_VOCAB_ROWS = 65_536  # the shipped draft vocabulary (DRAFT_VOCAB=1)

# Routed experts: NVFP4 = 4-bit values (2 per byte) + F8_E4M3 scale per 16 + F32 weight_scale_2 and
# input_scale per projection (the published checkpoints' safetensors headers).
_SIDE = re.compile(r"layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.(q_proj|k_proj|v_proj|o_proj)"
                   r"|self_attn\.indexer\.index_qk_proj|mlp\.shared_expert\.(gate_proj|up_proj|down_proj))\.weight(_scale|_scale_inv)?$")
# weight_scale: the FP8_PB_WO hybrid (variant format 2); weight_scale_inv: format-1 variants still on disk

COMPONENTS = ("routed_experts", "side_layers", "embeddings", "lm_head", "hyper_connections", "other_dense",
              "ple_projections", "vision", "mtp_experts", "mtp_dense", "draft_head_copy", "ple_table")


@dataclass
class Weights:
    components: dict[str, int]  # bytes resident on the GPU
    source: str  # "headers:<dir>" or "geometry"
    notes: list[str] = field(default_factory=list)
    on_disk: dict[str, int] = field(default_factory=dict)  # bytes in the checkpoint (table included)

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def outside_budget(self) -> int:
        """Patch 10's draft-head copy: on the GPU, but made after the peak of vLLM's profile run, which
        counts peak less end, so vLLM never budgets it (benchmarks/plan-real-shape, recipe48 run7)."""
        return self.components.get("draft_head_copy", 0)


def nvfp4_bytes(out_f: int, in_f: int) -> int:
    return out_f * in_f // 2 + out_f * (in_f // 16) + 8


def fp8_block_bytes(out_f: int, in_f: int, scale_bytes: int = 4) -> int:
    return out_f * in_f + (-(-out_f // 128)) * (-(-in_f // 128)) * scale_bytes


def side_layer_shapes(g: Geometry) -> list[tuple[int, int, int]]:
    """(count, N, K) of the dense projections `prepare hybrid` converts (hybrid convention)."""
    h, qkv = g.hidden_size, g.gdn_conv_dim
    z = g.linear_num_value_heads * g.linear_value_head_dim
    q = 2 * g.num_attention_heads * g.head_dim  # query + output gate
    kv = g.num_key_value_heads * g.head_dim
    o_in = g.num_attention_heads * g.head_dim
    se = g.shared_expert_intermediate_size
    L, A, G = g.num_hidden_layers, g.qsa_layers, g.gdn_layers
    idx = (g.indexer_n_heads + g.indexer_kv_heads) * g.indexer_head_dim
    return [(G, qkv, h), (G, z, h), (G, h, z), (A, q, h), (2 * A, kv, h), (A, h, o_in), (A, idx, h),
            (2 * L, se, h), (L, h, se)]


def geometry_estimate(g: Geometry, *, checkpoint: str, mode: str, mtp: int, draft_vocab: bool,
                      vision: bool, table_on_gpu: bool = False) -> Weights:
    """Bytes per component from the config numbers alone (no snapshot on disk)."""
    notes: list[str] = []
    h, inter = g.hidden_size, g.moe_intermediate_size
    expert_nvfp4 = 2 * nvfp4_bytes(inter, h) + nvfp4_bytes(h, inter)  # gate, up, down
    routed = g.num_hidden_layers * g.num_experts * expert_nvfp4
    side_params = sum(n * a * b for n, a, b in side_layer_shapes(g))
    hybrid = mode in ("hybrid", "hybrid-mtp")
    side = sum(n * fp8_block_bytes(a, b) for n, a, b in side_layer_shapes(g)) if hybrid else side_params * 2
    if checkpoint == "qad":
        side = sum(n * mxfp8_bytes(a, b) for n, a, b in side_layer_shapes(g))
        notes.append("side layers: MXFP8 as exported (QAD checkpoint; which layers a revision exports as MXFP8 "
                     "varies: the snapshot's headers are exact)")
    hc_w, lr = g.hc_width, g.hc_lowrank
    hc_module = hc_w + 2 * lr * hc_w + g.hc_count * hc_w  # hc_norm, down, up, block_inject
    hc = (2 * g.num_hidden_layers * hc_module + hc_w + 2 * lr * hc_w) * 2  # + final mixer
    gdn_small = g.gdn_layers * (2 * g.linear_num_value_heads * h + g.gdn_conv_dim * g.linear_conv_kernel_dim
                                + 2 * g.linear_num_value_heads + g.linear_value_head_dim)
    qsa_small = g.qsa_layers * (2 * g.head_dim + 2 * g.indexer_head_dim)
    moe_small = g.num_hidden_layers * (g.num_experts * h + h)
    other = (gdn_small + qsa_small + moe_small) * 2
    ple_proj = g.ple_layers * (g.hc_width * h + h * h + 3 * g.hc_width + g.hc_width * g.ple_conv_kernel_size) * 2
    vh, vi = g.vision_hidden, g.vision_intermediate
    vblock = 4 * vh * vh + 2 * vh * vi + 9 * vh + vi
    vmerge = (vh * g.vision_merge ** 2) ** 2 + vh * g.vision_merge ** 2 * g.vision_out_hidden
    vis = (g.vision_depth * vblock + vmerge + 3 * g.vision_temporal_patch * g.vision_patch ** 2 * vh + 2304 * vh) * 2
    comps = dict.fromkeys(COMPONENTS, 0)
    comps.update(routed_experts=routed, side_layers=side, embeddings=g.vocab_size * h * 2,
                 lm_head=g.vocab_size * h * 2, hyper_connections=hc, other_dense=other, ple_projections=ple_proj,
                 vision=vis if vision else 0)
    if mtp:
        per_expert = 3 * inter * h
        if mode == "hybrid-mtp":
            comps["mtp_experts"] = g.num_experts * expert_nvfp4
            notes.append("MTP experts: NVFP4 (the Inferact draft-expert graft)")
        elif checkpoint == "qad":
            comps["mtp_experts"] = g.num_experts * expert_nvfp4
            notes.append("MTP experts: NVFP4 weights (reported W4A16 for the QAD export; not read from a snapshot)")
        elif checkpoint == "nvidia":
            comps["mtp_experts"] = g.num_experts * 3 * fp8_block_bytes(inter, h, scale_bytes=2)
            notes.append("MTP experts: blockwise fp8 with bf16 scales (nvidia checkpoint)")
        else:
            comps["mtp_experts"] = g.num_experts * per_expert * 2
            notes.append("MTP experts: bf16" + (" (RadixArk checkpoint)" if checkpoint == "radixark"
                                                else f" (assumed for an unknown checkpoint: the largest case)"))
        # dense part of the drafter (29 tensors): 4.86 GiB total - 4.69 GiB experts (Minachist/Qwen3.8-Flash-Next-INT4-Mixed-AutoRound's model card)
        comps["mtp_dense"] = int(0.17 * GIB)
        if draft_vocab:
            comps["draft_head_copy"] = DRAFT_VOCAB_ROWS * h * 2
    on_disk = dict(comps)
    on_disk["ple_table"] = nvfp4_table_bytes(g) if checkpoint == "qad" else g.ple_table_bytes
    if table_on_gpu:
        comps["ple_table"] = on_disk["ple_table"]
    return Weights(comps, "geometry", notes, on_disk)


def classify(name: str) -> str:
    if name.startswith("mtp."):
        return "mtp_experts" if ".experts." in name else "mtp_dense"
    if ".ple.ple_embedding.ngram_embedding." in name:
        return "ple_table"
    if ".ple." in name:
        return "ple_projections"
    if name.startswith(("model.visual.", "visual.")):
        return "vision"
    if ".mlp.experts." in name:
        return "routed_experts"
    if _SIDE.search(name):
        return "side_layers"
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if "hyper_connection" in name:
        return "hyper_connections"
    return "other_dense"


def from_headers(model_dir: Path, g: Geometry, *, mode: str, mtp: int, draft_vocab: bool, vision: bool,
                 prepared: bool, table_on_gpu: bool = False) -> Weights:
    """Sum tensor bytes per component over every shard the index names. `prepared=False` for a
    hybrid mode means the variant is not built yet: the snapshot's bf16 side layers are converted
    on paper (fp8 + scales), like `prepare hybrid` would."""
    comps, side_bf16, cached = _header_sums(Path(model_dir))
    notes = [f"weights read from the safetensors headers in {model_dir}" + (" (cached summary)" if cached else "")]
    if mode in ("hybrid", "hybrid-mtp") and not prepared and side_bf16:
        comps["side_layers"] = sum(fp8_block_bytes(n, k) for n, k in side_bf16) + (comps["side_layers"] - sum(n * k * 2 for n, k in side_bf16))
        notes.append(f"{mode} variant not prepared yet: side layers converted on paper to fp8 + scales")
    if mode == "hybrid-mtp" and not prepared:
        expert_nvfp4 = 2 * nvfp4_bytes(g.moe_intermediate_size, g.hidden_size) + nvfp4_bytes(g.hidden_size, g.moe_intermediate_size)
        comps["mtp_experts"] = g.num_experts * expert_nvfp4
        notes.append("hybrid-mtp graft not prepared yet: MTP experts counted as NVFP4")
    on_disk = dict(comps)
    if not table_on_gpu:
        comps["ple_table"] = 0
    if not mtp:
        comps["mtp_experts"] = comps["mtp_dense"] = 0
    elif draft_vocab:
        comps["draft_head_copy"] = DRAFT_VOCAB_ROWS * g.hidden_size * 2
    if not vision:
        comps["vision"] = 0
    return Weights(comps, f"headers:{model_dir}", notes, on_disk)


def _cache_file(model_dir: Path) -> Path:
    import hashlib
    import os

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flash" / "plan" / (hashlib.sha1(str(model_dir.resolve()).encode()).hexdigest() + ".json")


def _stamp(model_dir: Path, files: list[str]) -> list:
    out = []
    for name in ["model.safetensors.index.json", *files]:
        st = (model_dir / name).stat()
        out.append([name, st.st_size, st.st_mtime_ns])
    return out


def _header_sums(model_dir: Path) -> tuple[dict[str, int], list[tuple[int, int]], bool]:
    """Per-component byte sums over the shards the index names (a tensor a file holds but the
    index maps elsewhere is not loaded from it). Reading a 300k-tensor checkpoint's headers takes
    seconds, so the summary is cached, keyed on the size and mtime of the index and every shard."""
    import json
    import os

    from flash_common.stheader import read_header, read_index

    index = read_index(model_dir)
    files = sorted(set(index.values()))
    stamp = _stamp(model_dir, files)
    cache = _cache_file(model_dir)
    try:
        data = json.loads(cache.read_text())
        if data.get("stamp") == stamp:
            return {**dict.fromkeys(COMPONENTS, 0), **data["components"]}, [tuple(x) for x in data["side_bf16"]], True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from ..output import say

    say(f"plan: reading the safetensors headers of {len(files)} files in {model_dir} (cached afterwards)")
    comps = dict.fromkeys(COMPONENTS, 0)
    side_bf16: list[tuple[int, int]] = []
    for fname in files:
        header = read_header(model_dir / fname)
        for name, info in header.tensors.items():
            if index.get(name) != fname:
                continue
            comp = classify(name)
            comps[comp] += info.nbytes
            if comp == "side_layers" and info.dtype == "BF16" and len(info.shape) == 2:
                side_bf16.append(tuple(info.shape))
    try:  # best effort: a read-only home only costs the next run the same seconds
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"stamp": stamp, "components": comps, "side_bf16": side_bf16}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return comps, side_bf16, False


def checkpoint_kind(model: str, snapshot: Path | None = None) -> str:
    """nvidia | radixark | qad (checkpoint/known.py: the index on disk, else the repo name) | other."""
    from ..checkpoint import known

    lay = known.layout_of(model, snapshot)
    if lay is not None:
        return lay.name
    org = model.split("/", 1)[0].lower()
    return org if org in ("nvidia", "radixark") else "other"


def mxfp8_bytes(out_f: int, in_f: int) -> int:
    """MXFP8 (the QAD export's side layers): E4M3 values + one UE8M0 byte per 32."""
    return out_f * in_f + out_f * (-(-in_f // 32))


def nvfp4_table_bytes(g: Geometry) -> int:
    """The QAD export's PLE table: two E2M1 values a byte + an E4M3 scale per 16, + the F32 global."""
    w = g.ple_row_width
    return g.ple_table_rows * (w // 2 + w // 16) + 4
