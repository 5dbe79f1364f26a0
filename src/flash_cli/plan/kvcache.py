"""The KV cache as vLLM's hybrid allocator lays it out for qwen4_exp, re-derived in plain Python.

Every step names the vLLM function it mirrors (read in the 0.29.0 and 0.33.0 wheels; 0.30–0.32
match 0.29 on every point used here). docs/PLAN.md walks through the same steps with numbers.

1. Per-layer specs (`get_kv_cache_spec` of each layer):
   - QSA main K/V, `nvidia/qsa.py::Qwen4ExpQSAAttention.get_kv_cache_spec` → `FullAttentionSpec`
     (2 KV heads × (256 K + 256 V) × dtype bytes per token);
   - QSA compressed index keys, `common/qsa_cache.py::QSACompressedKeyCache` → `MLAAttentionSpec`
     (1 head × 128 × bf16 per *state*, `tokens_per_state = indexer_compress_ratio` = 4 → 64 B/token);
   - QSA raw-key ring, `QSAKeyStateCache` → `CircularBufferSpec`, one block per request whose
     `block_size` is the ring capacity `round_up(ratio + num_speculative_tokens, ratio)`;
   - GDN state, `mamba/abstract.py::MambaBase.get_kv_cache_spec` with
     `MambaStateShapeCalculator.gated_delta_net_state_shape` (conv (conv_dim, 3 + k) in the model
     dtype, SSM (48, 128, 128) in `mamba_ssm_dtype` float32);
   - PLE short-conv state, `nvidia/ple_layer.py` (`MambaSpec`, `tp_replicated=True`,
     conv (hc_width, (kernel-1)·ngram + k));
   - the MTP drafter adds one more QSA layer (main + compressed + ring).
2. Block size: `platforms/interface.py::Platform._align_hybrid_block_size` raises the attention
   block so one attention page ≥ the largest Mamba page, in multiples of the kernel alignment (16;
   on 0.33 in prefix-caching "align" mode also `lcm(…, 64)` when the FlashInfer GDN prefill exports
   checkpoints), then pads the Mamba pages (`mamba_page_size_padded`) to exactly one attention page.
3. Groups: the QSA state backend only accepts block-outermost layouts (`QSAStateBackend.
   supported_kv_cache_layouts` → BLNHC/BLHNC), so `get_kv_cache_groups` takes
   `_get_packed_kv_cache_groups`: greedy buckets by `UniformTypeKVCacheSpecs.is_uniform_type`,
   `_approximate_gcd` for the repeats per group, Mamba buckets split to fit the anchor block.
4. Pool: `get_kv_cache_config_from_groups`: `bytes_per_block = max(Σ page of a group)`
   (`_get_kv_cache_bytes_per_block`), `num_blocks = available // bytes_per_block`.
5. What the boot log prints: `kv_cache_utils.get_max_concurrency_for_kv_cache_config` (blocks one
   request at max_model_len needs, summed over groups: `cdiv(max_memory_usage_bytes, page)`) and
   `get_kv_cache_capacity` → "GPU KV cache size: int(concurrency × max_model_len) tokens".
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from flash_common import releases

from ..geometry import Geometry

KERNEL_BLOCK = 16  # Qwen4ExpQSAFlashAttentionBackend.get_supported_kernel_block_sizes → [MultipleOf(16)]
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64  # 0.33 v1/attention/backends/gdn_attn.py
BF16 = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


@dataclass(frozen=True)
class Spec:
    """One layer's cache spec, reduced to what allocation depends on."""

    layer: str
    kind: str  # full | mla | ring | mamba
    block_size: int
    page: int  # bytes of one block (after padding)
    tokens_per_page: int = 0  # full/mla: tokens one page covers
    mamba_blocks: int = 0  # mamba: blocks one request holds (`MambaSpec.max_memory_usage_bytes`)
    tp_replicated: bool = False
    mamba_key: tuple = ()  # what `MambaSpec.is_uniform_with_collection` compares
    label: str = ""  # what the layer holds (qsa_kv, qsa_index_keys, qsa_ring, gdn_state, ple_conv_state)

    def blocks_per_request(self, max_len: int) -> int:
        if self.kind in ("full", "mla"):
            return cdiv(max_len, self.block_size)  # FullAttentionSpec.max_memory_usage_bytes / page
        if self.kind == "ring":
            return 1  # CircularBufferSpec: one block per request for its lifetime
        return self.mamba_blocks


def _uniform(specs: list[Spec]) -> bool:
    """`UniformTypeKVCacheSpecs.is_uniform_type`: one block size, then the first spec's
    `is_uniform_with_collection` (Full and MLA share the FullAttentionSpec base in the registry)."""
    if len({s.block_size for s in specs}) > 1:
        return False
    first = specs[0]
    if first.kind in ("full", "mla"):
        return all(s.kind in ("full", "mla") for s in specs)
    if first.kind == "ring":
        return all(s.kind == "ring" for s in specs)
    return all(s.kind == "mamba" and s.mamba_key == first.mamba_key for s in specs)


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """`kv_cache_utils._approximate_gcd`: the d ≥ lower_bound with least upward padding,
    ties to the larger d."""
    best_d, best_pad = max(1, lower_bound), None
    for d in range(max(1, lower_bound), max(values) + 1):
        pad = sum((d - (x % d)) % d for x in values)
        if best_pad is None or pad < best_pad or (pad == best_pad and d > best_d):
            best_d, best_pad = d, pad
    return best_d


@dataclass
class Group:
    layers: list[Spec]

    @property
    def bytes(self) -> int:
        return sum(s.page for s in self.layers)

    def blocks_per_request(self, max_len: int) -> int:
        # UniformTypeKVCacheSpecs.max_memory_usage_pages: the widest member decides
        return max(s.blocks_per_request(max_len) for s in self.layers)

    def describe(self) -> str:
        kinds = Counter(s.label or s.kind for s in self.layers)
        return " + ".join(f"{n}×{k}" for k, n in kinds.items())


def packed_groups(specs: list[Spec], state_buckets_include_ring: bool) -> list[Group]:
    """`kv_cache_utils._get_packed_kv_cache_groups` (block-outermost layout)."""
    buckets: list[list[Spec]] = []
    for spec in specs:
        for bucket in buckets:
            if _uniform(bucket + [spec]):
                bucket.append(spec)
                break
        else:
            buckets.append([spec])

    def by_page(bucket: list[Spec]) -> dict[int, list[Spec]]:
        out: dict[int, list[Spec]] = {}
        for s in bucket:
            out.setdefault(s.page, []).append(s)
        return out

    def max_layers_per_page(bucket: list[Spec]) -> int:
        return Counter(s.page for s in bucket).most_common(1)[0][1]

    info = []
    for bucket in buckets:
        pages = by_page(bucket)
        balanced = len({len(v) for v in pages.values()}) == 1
        info.append((bucket, pages, balanced))

    min_repeats = max((max_layers_per_page(b) for b, p, bal in info if bal and len(p) > 1), default=0)
    repeats = (_approximate_gcd([max_layers_per_page(b) for b, _, bal in info if bal], min_repeats)
               if min_repeats else None)

    def num_groups_for(bucket: list[Spec], balanced: bool) -> int:
        if balanced and repeats is not None:
            return cdiv(max_layers_per_page(bucket), repeats)
        return 1

    def is_state(bucket: list[Spec]) -> bool:
        return bucket[0].kind == "mamba" or (state_buckets_include_ring and bucket[0].kind == "ring")

    def widest(pages: dict[int, list[Spec]], n: int) -> int:
        return sum(cdiv(len(v), n) * page for page, v in pages.items())

    anchor = max((widest(p, len(b) if is_state(b) else num_groups_for(b, bal)) for b, p, bal in info), default=0)

    groups: list[Group] = []
    for bucket, pages, balanced in info:
        n = num_groups_for(bucket, balanced)
        if anchor and is_state(bucket):
            per_block = max(anchor // bucket[0].page, 1)
            n = max(n, cdiv(len(bucket), per_block))
        if n == 1:
            groups.append(Group(list(bucket)))
            continue
        repeats_list = list(zip(*pages.values()))
        for i in range(n):
            groups.append(Group([s for rep in repeats_list[i::n] for s in rep]))
    return groups


@dataclass
class KVLayout:
    """The allocation vLLM would compute, before the memory budget is known."""

    base: str
    kv_dtype_bytes: int
    num_spec: int
    prefix_cache: bool
    max_model_len: int
    block_size: int
    mamba_page_unpadded: int
    attn_page_per_token: int
    ring_capacity: int
    specs: list[Spec]
    groups: list[Group]
    bytes_per_block: int
    blocks_per_request: int
    notes: list[str] = field(default_factory=list)
    checkpoints: bool = False  # 0.33 Mamba prefill checkpoints (one more state block per request)
    ring_page_unpadded: int = 0
    state_pages: dict = field(default_factory=dict)  # unpadded GDN / PLE state bytes per block

    @property
    def tokens_per_block(self) -> int:
        return self.block_size

    def num_blocks(self, available_bytes: int) -> int:
        return max(available_bytes, 0) // self.bytes_per_block

    def concurrency(self, available_bytes: int) -> float:
        return self.num_blocks(available_bytes) / self.blocks_per_request

    def tokens(self, available_bytes: int) -> int:
        """The number the boot log prints as "GPU KV cache size: N tokens"."""
        return int(self.concurrency(available_bytes) * self.max_model_len)

    def bytes_for_requests(self, n: int, length: int) -> int:
        """Pool bytes n requests of `length` tokens hold (blocks of every group)."""
        return n * sum(g.blocks_per_request(length) for g in self.groups) * self.bytes_per_block

    def per_cache(self) -> list[dict]:
        """Each kind of cache: layers, unpadded bytes per context token (K/V, index keys) or per
        request (ring, GDN and PLE states), and the page every one of them occupies in the pool."""
        rows: dict[str, dict] = {}
        for s in self.specs:
            row = rows.setdefault(s.label, {"cache": s.label, "layers": 0, "page_bytes": s.page})
            row["layers"] += 1
        for label, row in rows.items():
            n = row["layers"]
            if label == "qsa_kv":
                row["bytes_per_token"] = n * self.attn_page_per_token
            elif label == "qsa_index_keys":
                row["bytes_per_token"] = n * next(s.page for s in self.specs if s.label == label) // self.block_size
            else:
                spec = next(s for s in self.specs if s.label == label)
                row["blocks_per_request"] = spec.blocks_per_request(self.max_model_len)
                row["bytes_per_request_unpadded"] = n * (self.ring_page_unpadded if label == "qsa_ring" else
                                                         self.state_pages[label]) * row["blocks_per_request"]
        return list(rows.values())

    def bytes_per_token(self) -> float:
        """Marginal pool bytes per context token: what one more token of one request costs,
        averaged over a block (the per-request state blocks are not per token)."""
        per_block_tokens = sum(1 for g in self.groups if any(s.kind in ("full", "mla") for s in g.layers))
        return per_block_tokens * self.bytes_per_block / self.block_size


def layout(geom: Geometry, *, base: str, kv_dtype: str, mtp: int, prefix_cache: bool, max_model_len: int,
           flashinfer_gdn: bool = True, user_block_size: int | None = None) -> KVLayout:
    """Specs → block size → groups → per-block bytes and per-request blocks, for one release line."""
    notes: list[str] = []
    kv_bytes = 1 if kv_dtype.startswith("fp8") else BF16
    k = mtp

    # 1. Mamba pages (unpadded): GDN and PLE short conv.
    gdn_conv = geom.gdn_conv_dim * (geom.linear_conv_kernel_dim - 1 + k) * BF16
    gdn_ssm = geom.linear_num_value_heads * geom.linear_value_head_dim * geom.linear_key_head_dim * geom.mamba_ssm_dtype_bytes
    gdn_page = gdn_conv + gdn_ssm
    ple_page = geom.hc_width * (geom.ple_conv_state_len + k) * BF16
    mamba_page = max(gdn_page, ple_page)

    # 2. Platform._align_hybrid_block_size
    attn_page_1 = geom.num_key_value_heads * 2 * geom.head_dim * kv_bytes
    # kernel_block_alignment_size = max(kernel minimum, cache_config.block_size): a user's
    # --block-size is both the floor and the alignment
    align = max(KERNEL_BLOCK, user_block_size or 0)
    checkpoints = releases.has(base, "mamba_prefill_checkpoints") and prefix_cache and flashinfer_gdn
    if checkpoints:
        # get_mamba_prefill_checkpoint_alignment: lcm(GDN 64 (FlashInfer prefill), PLE 1)
        align = math.lcm(align, FLASHINFER_GDN_CHECKPOINT_ALIGNMENT)
    block = align * cdiv(mamba_page, align * attn_page_1)
    block = round_up(block, KERNEL_BLOCK)
    attn_page = block * attn_page_1
    ratio = geom.indexer_compress_ratio
    ring_capacity = round_up(ratio + k, ratio)
    if block % ring_capacity:
        raise ValueError(f"QSA ring capacity {ring_capacity} does not divide the block size {block}")

    # 1b. the specs, in registration order (layer by layer; a QSA layer registers its ring and
    # compressed cache from the indexer before the attention itself)
    mamba_blocks_align = 2 + k + (1 if checkpoints else 0)
    mamba_blocks = mamba_blocks_align if prefix_cache else 1 + k
    mamba_block_size = block if prefix_cache else max_model_len
    compressed_page = (block // ratio) * geom.indexer_head_dim * BF16  # indexer K stays bf16
    ring_width = geom.indexer_head_dim + 12  # + 3 int64 MRoPE positions as bf16 pairs (uses_mrope)
    ring_page = ring_capacity * ring_width * BF16
    specs: list[Spec] = []

    def qsa(prefix: str) -> None:
        specs.append(Spec(f"{prefix}.raw_key_cache", "ring", ring_capacity, ring_page, label="qsa_ring"))
        specs.append(Spec(f"{prefix}.compressed_key_cache", "mla", block, compressed_page, tokens_per_page=block,
                          label="qsa_index_keys"))
        specs.append(Spec(f"{prefix}.attn", "full", block, attn_page, tokens_per_page=block, label="qsa_kv"))

    for i in range(geom.num_hidden_layers):
        if (i + 1) % geom.full_attention_interval == 0:
            qsa(f"model.layers.{i}.self_attn")
        else:
            specs.append(Spec(f"model.layers.{i}.linear_attn", "mamba", mamba_block_size, attn_page,
                              mamba_blocks=mamba_blocks, mamba_key=(k, attn_page, False), label="gdn_state"))
            if i + 1 in geom.ple_layer_ids:  # vLLM: (layer_idx + 1) in ple_layer_ids
                specs.append(Spec(f"model.layers.{i}.ple", "mamba", mamba_block_size, attn_page,
                                  mamba_blocks=mamba_blocks, tp_replicated=True, mamba_key=(k, attn_page, True),
                                  label="ple_conv_state"))
    if mtp:
        for j in range(geom.mtp_num_hidden_layers):
            qsa(f"mtp.layers.{geom.num_hidden_layers + j}.self_attn")

    # 3. grouping (0.30+ also treats the ring bucket as a state bucket; same result here)
    groups = packed_groups(specs, state_buckets_include_ring=releases.has(base, "ring_state_bucket"))
    # 4. bytes per block
    bytes_per_block = max(g.bytes for g in groups)
    per_request = sum(g.blocks_per_request(max_model_len) for g in groups)
    if checkpoints:
        notes.append("0.33 + prefix caching: FlashInfer GDN prefill exports checkpoints "
                     "(block aligned to 64, +1 state block per Mamba group per request)")
    return KVLayout(base=base, kv_dtype_bytes=kv_bytes, num_spec=k, prefix_cache=prefix_cache,
                    max_model_len=max_model_len, block_size=block, mamba_page_unpadded=mamba_page,
                    attn_page_per_token=attn_page_1, ring_capacity=ring_capacity, specs=specs, groups=groups,
                    bytes_per_block=bytes_per_block, blocks_per_request=per_request, notes=notes,
                    checkpoints=checkpoints, ring_page_unpadded=ring_page,
                    state_pages={"gdn_state": gdn_page, "ple_conv_state": ple_page})
