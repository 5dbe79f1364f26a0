"""Patch 5: exact QSA block top-k (modes of the upstream recipe's `VLLM_QSA_EXACT_TOPK`)."""

from flash_common import releases

from ...registry import Gate, Patch
from . import hook

ALL = hook.PORTED  # the catalogue's qsa_topk_site: where there is a block top-k to hook
NOT_PORTED = {b: "no port of the QSA top-k hook to this release (catalogue: qsa_topk_site=None)"
              for b in releases.where("qsa_topk_site", None)}

PATCH = Patch(
    number=5,
    name="qsa-exact-topk",
    title="Exact QSA block top-k",
    why=("The stock `persistent_topk` can drop top-k candidates when many scores share a coarse "
         "histogram bin (vllm#51782), so QSA may attend to the wrong blocks. Mode 1 selects the "
         "blocks with `torch.topk` over the visible columns only, written in ascending block order "
         "(the stock kernels' order when every visible block is chosen: the attention's rounding "
         "follows the order, run41); `fill` masks the never-written columns and keeps the stock "
         "kernel (diagnostic)."),
    upstream="vllm#51782 (open); vLLM's `sparse_indexer_topk_backend` reaches only the DSA indexer",
    gate=Gate("VLLM_QSA_EXACT_TOPK", "VLLM_QSA_EXACT_TOPK=1|fill",
              lambda e: e.get("VLLM_QSA_EXACT_TOPK", "").strip().lower() in
              ("1", "true", "yes", "on", "fill")),
    targets=("vllm.models.qwen4_exp.nvidia.ops.qsa:qsa_select_paged_tokens (v0.29)",
             "vllm.models.qwen4_exp.nvidia.ops.qsa_indexer:_topk (v0.30+)"),
    applies_to=ALL,
    not_ported=NOT_PORTED,
    check=hook.check,
    apply=hook.install_hook,
    verify=hook.verify,
    traced=hook.TRACED,
    knobs=hook.knobs,
)
