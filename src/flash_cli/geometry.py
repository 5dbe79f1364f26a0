"""Qwen3.8-Flash-Next geometry: the config.json numbers the memory model needs.

Defaults are the real checkpoint's `text_config` (its published config.json, identical in
nvidia/ and RadixArk/). When a snapshot is present its config.json overrides them,
so a derivative with another shape is planned from its own numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class Geometry:
    hidden_size: int = 2560
    num_hidden_layers: int = 48
    full_attention_interval: int = 4  # every 4th layer is QSA (3, 7, …, 47)
    vocab_size: int = 248320
    # QSA main attention
    num_attention_heads: int = 24
    num_key_value_heads: int = 2
    head_dim: int = 256
    # QSA indexer
    indexer_n_heads: int = 4
    indexer_kv_heads: int = 1
    indexer_head_dim: int = 128
    indexer_budget: int = 2048
    indexer_compress_ratio: int = 4
    # GDN (linear attention)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    mamba_ssm_dtype_bytes: int = 4  # `mamba_ssm_dtype: "float32"` (Qwen3_5…Config copies it)
    # MoE
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 640
    shared_expert_intermediate_size: int = 640
    # hyper-connections
    hc_count: int = 4
    hc_lowrank: int = 320
    # PLE (n-gram table on decoder layer index 1)
    ple_layer_ids: tuple[int, ...] = (2,)  # 1-indexed: decoder layer index 1 (a GDN layer)
    ple_embed_dim: int = 2560
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ple_table_rows: int = 320_001_536  # padded to a multiple of 128 (§2.1)
    ple_table_bytes_per_elem: int = 1  # fp8 (RadixArk, nvidia); Inferact ships bf16
    # MTP drafter
    mtp_num_hidden_layers: int = 1
    # vision tower
    vision_depth: int = 27
    vision_hidden: int = 1152
    vision_intermediate: int = 4304
    vision_out_hidden: int = 2560
    vision_patch: int = 16
    vision_temporal_patch: int = 2
    vision_merge: int = 2

    @property
    def qsa_layers(self) -> int:
        return self.num_hidden_layers // self.full_attention_interval

    @property
    def gdn_layers(self) -> int:
        return self.num_hidden_layers - self.qsa_layers

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def ple_layers(self) -> int:
        return len(self.ple_layer_ids)

    @property
    def hc_width(self) -> int:
        return self.hc_count * self.hidden_size

    @property
    def ple_conv_state_len(self) -> int:
        # dilated depthwise conv: (kernel - 1) * dilation, dilation = ngram_size
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def ple_row_width(self) -> int:
        return self.ple_embed_dim // ((self.ngram_size - 1) * self.heads_per_ngram)  # 160

    @property
    def ple_table_bytes(self) -> int:
        return self.ple_table_rows * self.ple_row_width * self.ple_table_bytes_per_elem


REAL = Geometry()

# What sets one decoder layer's tensors (and the kernels vLLM picks for them); not the depth, the PLE
# table's rows, the QSA budget, the drafter's depth or the vision tower
LAYER_SHAPE = ("hidden_size", "full_attention_interval", "vocab_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_compress_ratio",
               "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "hc_count", "hc_lowrank")


def real_layer_shape(g: Geometry) -> bool:
    """Whether `g`'s layers are the real model's (any depth): a bench checkpoint of 32 of the 48
    layers is, a tiny test fixture is not."""
    return all(getattr(g, k) == getattr(REAL, k) for k in LAYER_SHAPE)


REAL_NGRAM_BASE = 20_000_000


def table_rows_for_base(text: dict, ngram_size: int, heads_per_ngram: int) -> int | None:
    """The PLE table's rows for a config whose `ngram_vocab_size_base` is not the real 20,000,000
    (a reduced bench table, another checkpoint's n-gram parameters); None keeps the real count.
    Each of the (ngram_size - 1) x heads_per_ngram heads has the first prime >= the base as its
    vocabulary, padded to `make_ngram_vocab_size_divisible_by`; heads x base stands for the primes
    (short of them by the prime gaps above the base: ~2,200 rows of 32,002,176 at a 2,000,000 base,
    0.3 MB of a 4.8 GiB table), so a plan need not search for primes."""
    base = text.get("ngram_vocab_size_base")
    if not isinstance(base, int) or isinstance(base, bool) or base <= 0 or base == REAL_NGRAM_BASE:
        return None
    div = text.get("make_ngram_vocab_size_divisible_by", 128)
    div = div if isinstance(div, int) and div > 0 else 128
    return -(-(ngram_size - 1) * heads_per_ngram * base // div) * div


def from_config(config_path: Path) -> Geometry:
    """Geometry from a snapshot's config.json (`text_config` when nested). Missing keys keep the
    real checkpoint's values; layer_types, when given, decides the QSA interval."""
    raw = json.loads(Path(config_path).read_text(encoding="utf-8"))
    text = raw.get("text_config", raw)
    known = {f.name for f in fields(Geometry)}
    changes = {k: int(v) for k, v in text.items() if k in known and isinstance(v, int) and not isinstance(v, bool)}
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        full = [i for i, t in enumerate(types) if t in ("full_attention", "indexed_attention")]
        if full and len(types) % len(full) == 0:
            changes["full_attention_interval"] = len(types) // len(full)
    if text.get("mamba_ssm_dtype") in ("bfloat16", "float16"):
        changes["mamba_ssm_dtype_bytes"] = 2
    ple = text.get("ple_layer_ids")
    if isinstance(ple, list) and all(isinstance(x, int) for x in ple):
        changes["ple_layer_ids"] = tuple(ple)
    mtp = text.get("mtp_num_hidden_layers")
    if isinstance(mtp, int):
        changes["mtp_num_hidden_layers"] = mtp
    rows = table_rows_for_base(text, changes.get("ngram_size", REAL.ngram_size),
                               changes.get("heads_per_ngram", REAL.heads_per_ngram))
    if rows is not None:
        changes["ple_table_rows"] = rows
    vision = raw.get("vision_config") or {}
    for src, dst in (("depth", "vision_depth"), ("hidden_size", "vision_hidden"),
                     ("intermediate_size", "vision_intermediate"), ("out_hidden_size", "vision_out_hidden")):
        if isinstance(vision.get(src), int):
            changes[dst] = vision[src]
    return replace(REAL, **changes)


def per_rank(g: Geometry, tp: int = 1, pp: int = 1) -> Geometry:
    """What one rank of a tensor-parallel (tp) / pipeline-parallel (pp) deployment holds, as a
    geometry the KV layout can be computed from (vLLM sizes each rank's pool from its own layers):
    tp splits the QSA heads and the GDN heads (so the conv dimension), but the QSA KV heads only
    down to one per rank: above `num_key_value_heads` ranks they are replicated (nvidia/qsa.py:
    num_kv_heads = max(1, total // tp)); the indexer's one KV head and the PLE state are replicated
    at any tp (`tp_replicated=True`). pp gives each stage num_hidden_layers / pp layers (the PLE
    layer and the MTP drafter are kept on every stage: the first and the last hold them, and the
    pool is the smallest stage's, so this is the bound). layout.py checks the sizes divide."""
    return replace(g, num_attention_heads=g.num_attention_heads // tp,
                   num_key_value_heads=max(1, g.num_key_value_heads // tp),
                   linear_num_key_heads=g.linear_num_key_heads // tp,
                   linear_num_value_heads=g.linear_num_value_heads // tp,
                   num_hidden_layers=g.num_hidden_layers // pp)
