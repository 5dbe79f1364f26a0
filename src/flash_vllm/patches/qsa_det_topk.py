"""Patch 8: deterministic QSA block selection, routed to patch 5's exact path."""

from ..registry import Gate, Patch
from . import _qsa_topk
from .qsa_topk import ALL

PATCH = Patch(
    number=8,
    name="qsa-det-topk",
    title="Deterministic QSA block top-k",
    why=("Greedy decoding should repeat itself (vllm#54521). The upstream recipe downloads and "
         "compiles a deterministic `persistent_topk` (vllm#55122) inside the image build. We route "
         "block selection to patch 5's exact `torch.topk` path instead: no network or nvcc in the "
         "build, one code path to test, and the result is the exact top-k, identical across calls. "
         "The kernel's author later traced real-traffic nondeterminism to upstream score "
         "differences rather than ties, so this makes selection exact and repeatable, not the "
         "whole forward. `VLLM_QSA_EXACT_TOPK` wins when both are set. That path costs 5.5-34.6x "
         "the stock kernels on the H200 (it sorts the whole row, max_model_len wide); "
         "`VLLM_QSA_DET_TOPK=radix` selects a candidate Triton kernel that reads only the visible "
         "columns, ties to the lowest column (`_qsa_radix.py`), not yet measured on a GPU."),
    upstream="vllm#55122 (deterministic persistent_topk, open); vllm#54521 (issue, open)",
    gate=Gate("VLLM_QSA_DET_TOPK", "VLLM_QSA_DET_TOPK=1 (or =radix)", _qsa_topk.det_enabled),
    targets=("same hook as patch 5",),
    applies_to=ALL,
    check=_qsa_topk.check,
    apply=_qsa_topk.install_hook,
    verify=_qsa_topk.verify,
)
