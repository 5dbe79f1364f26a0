"""Patch 8: deterministic QSA block selection, routed to patch 5's exact path (or, opt-in, to a
Triton kernel in `_qsa_radix.py`)."""

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
         "`VLLM_QSA_DET_TOPK=radix` selects a Triton radix select that reads only the visible "
         "columns, ties to the lowest column (`_qsa_radix.py`; run4: 2.5x stock at 8k context, 11x "
         "at 128k). `VLLM_QSA_DET_TOPK=repair` keeps the stock kernel and rewrites its output in one "
         "pass over the visible columns: above the smallest selected score every column is "
         "selected by any exact top-k, so only the ties at that score are re-picked (lowest columns "
         "first), the same answer as `radix` whenever the stock selection is an exact top-k (vllm#51782, "
         "patch 5's case, is one where it is not; the output then stays well-formed). A candidate "
         "until it is timed on a GPU."),
    upstream="vllm#55122 (deterministic persistent_topk, open); vllm#54521 (issue, open)",
    gate=Gate("VLLM_QSA_DET_TOPK", "VLLM_QSA_DET_TOPK=1 (or =radix, =repair)", _qsa_topk.det_enabled),
    targets=("same hook as patch 5",),
    applies_to=ALL,
    check=_qsa_topk.check,
    apply=_qsa_topk.install_hook,
    verify=_qsa_topk.verify,
)
