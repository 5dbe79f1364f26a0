"""Patch 8: deterministic QSA block selection: the stock kernel repaired by the Triton kernels in
`radix.py` (the default), or patch 5's exact path, or the radix select alone."""

from ...registry import Gate, Patch
from ..p05_qsa_exact_topk import ALL, NOT_PORTED, hook

PATCH = Patch(
    number=8,
    name="qsa-det-topk",
    title="Deterministic QSA block top-k",
    why=("Greedy decoding should repeat itself (vllm#54521). The upstream recipe downloads and "
         "compiles a deterministic `persistent_topk` (vllm#55122) inside the image build; we build "
         "nothing (no network or nvcc in the image build). `VLLM_QSA_DET_TOPK=repair` (flash's "
         "default) keeps the stock kernel and rewrites its output with two Triton launches over the "
         "visible columns (`radix.py`): the smallest selected score t is the k-th largest exactly "
         "when fewer than k scores of the row are above t and at least k reach it (a certificate read "
         "off the counts); then every score above t is taken and the ties at t go to the lowest "
         "columns. Where the certificate fails (the stock kernel dropped a candidate, vllm#51782) the "
         "kernel finds the k-th score itself by radix select, so the result is the exact top-k "
         "whatever the stock kernel returned. H200, graphs (run44, before the certificate): "
         "1.9-3.4x the stock kernel alone at 8k-128k context. `=1` routes to patch 5's exact "
         "`torch.topk` over the whole row, max_model_len wide (10-40x stock); `=radix` runs the "
         "radix select alone (2.4x at 8k, 11x at 128k). Every mode writes the selection in ascending "
         "column order. The kernel's author later traced real-traffic nondeterminism to upstream score "
         "differences rather than ties, so this makes selection exact and repeatable, not the whole "
         "forward. `VLLM_QSA_EXACT_TOPK` wins when both are set."),
    upstream="vllm#55122 (deterministic persistent_topk, open); vllm#54521 (issue, open)",
    gate=Gate("VLLM_QSA_DET_TOPK", "VLLM_QSA_DET_TOPK=repair (or =1, =radix)", hook.det_enabled),
    targets=("same hook as patch 5",),
    applies_to=ALL,
    not_ported=NOT_PORTED,
    check=hook.check,
    apply=hook.install_hook,
    verify=hook.verify,
    traced=hook.TRACED,
    knobs=hook.knobs,
)
