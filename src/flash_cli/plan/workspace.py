"""Memory vLLM takes while serving that its profile run never measured, so it is outside GPU_MEM.

vLLM sizes the KV pool from a profile run that builds no attention metadata (the V2 runner:
`_dummy_run(skip_attn=True)`; the V1 runner: metadata only under FULL graphs or force_attention), so
the QSA indexer returns at once there and its top-k never runs. The first prefill that does run it
allocates the float32 logits it selects from, and PyTorch's caching allocator keeps that block for
the life of the server. How big, per release (vllm/models/qwen4_exp/nvidia/ops/):

- 0.29 `qsa.py` `qsa_select_paged_tokens` (decode and prefill alike): logits [rows, columns] in
  chunks of at most `_LOGITS_WORKSPACE_BYTES` (128 MiB), columns = the page table's width × the
  compressed cache's page (every row scores the request's whole table);
- 0.30 `qsa_indexer.py` `qsa_select_paged_prefill`: chunks of at most
  `VLLM_SPARSE_INDEXER_MAX_LOGITS_MB` (512) of [rows, cdiv(seq, ratio) rounded up to 64];
- 0.31 on: that many MiB allocated whole on every prefill ("always allocate the worst case"), or
  the table's columns × 4 B when larger.

The worst case is what a long prompt meets; tests/vllm/release/check_logits_workspace.py runs each
release's own function with its kernels stubbed and holds these numbers to what it allocates.
"""

from __future__ import annotations

from flash_common import releases

MIB = 1024**2
MAX_LOGITS_MB = 512  # vllm.envs VLLM_SPARSE_INDEXER_MAX_LOGITS_MB's default (0.30 on); flash never sets it
CHUNK_029 = 128 * MIB  # 0.29's _LOGITS_WORKSPACE_BYTES


def table_columns(ctx: int, block_size: int, compress_ratio: int) -> int:
    """Compressed rows one request's page table spans at CTX: pages × rows per page."""
    return -(-ctx // block_size) * (block_size // compress_ratio)


def qsa_logits_bytes(base: str, ctx: int, block_size: int, compress_ratio: int, batched_tokens: int,
                     max_logits_mb: int = MAX_LOGITS_MB) -> int:
    """The largest logits block the indexer's top-k allocates in one step: a prompt near CTX whose
    step carries `batched_tokens` rows (0.29/0.30 chunk the rows; 0.31 on allocates the cap whole)."""
    kind = releases.cap(base, "qsa_logits_workspace")
    columns = table_columns(ctx, block_size, compress_ratio)
    if kind == "chunks-128":
        row = columns * 4
        return min(batched_tokens, max(1, CHUNK_029 // row)) * row
    cap = max_logits_mb * MIB
    if kind == "chunks-env":
        width = min(max(64, -(-(-(-ctx // compress_ratio)) // 64) * 64), columns)  # cdiv(seq, ratio) up to 64
        return min(batched_tokens, max(1, cap // (width * 4))) * width * 4
    return max(cap, columns * 4)  # worst-case-env


def describe(base: str) -> str:
    """How this release sizes the logits, in a phrase for the plan's assumptions."""
    return {"chunks-128": "chunks of at most 128 MiB",
            "chunks-env": f"chunks of at most VLLM_SPARSE_INDEXER_MAX_LOGITS_MB={MAX_LOGITS_MB}",
            "worst-case-env": f"VLLM_SPARSE_INDEXER_MAX_LOGITS_MB={MAX_LOGITS_MB} allocated whole on every prefill",
            }[releases.cap(base, "qsa_logits_workspace")]
