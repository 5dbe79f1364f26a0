"""Patch 10: reduced draft vocabulary for the MTP drafter.

The MTP drafter shares the target's LM head: every draft step multiplies by all 248,320 rows
(1.27 GiB bf16) although accepted drafts come almost entirely from the frequent tokens. This
wraps `Qwen4ExpMTP.compute_logits`: on the first call it slices a private contiguous copy of
the shared head's rows for the id set (65,536 x 2560 bf16 = 320 MiB), then each call runs the
reduced GEMM and scatters into a full-width tensor filled with -inf. Everything downstream
(argmax, gumbel sampling into the draft-logits cache, the rejection sampler, vocab mapping)
sees `[T, vocab]` as before. Probabilistic drafting stays exact: every column is written, so
the cache's 0.0 fill never leaks, and the draft distribution simply puts zero mass outside
the set, which rejection sampling against the target handles for any proposal. The target
verifies every draft, so outputs are unchanged; only acceptance can drop.

`VLLM_MTP_DRAFT_VOCAB`: unset/0 off; `default` (or 1) the id set shipped in
`flash_vllm/data/draft_vocab_65536.npy` (built by the checkpoint pipeline); an absolute path to
an .npy of token ids. The ids are loaded and validated in `register()` so a bad file stops the
boot. Passes through (with one warning) where the head is not a plain, unsharded weight (TP>1,
or v0.33's `draft_lm_head_quantization`), and on the local-argmax path, which never calls
compute_logits.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from flash_common import releases

from ...registry import Context, Gate, Patch, TargetMissing, expect_installed, expect_source, install

NUMBER = 10
TARGET = ("vllm.models.qwen4_exp.nvidia.mtp", "Qwen4ExpMTP.compute_logits")
ENV = "VLLM_MTP_DRAFT_VOCAB"
DEFAULT_FILE = "draft_vocab_65536.npy"
log = logging.getLogger("vllm.flash")


class DraftVocabError(ValueError):
    pass


def data_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "data"  # flash_vllm/data


def resolve_path(value: str | None) -> Path | None:
    v = (value or "").strip()
    if v.lower() in ("", "0", "false", "no", "off"):
        return None
    if v.lower() in ("default", "1", "true", "yes", "on"):
        return data_dir() / DEFAULT_FILE
    p = Path(v)
    if not p.is_absolute() or p.suffix != ".npy":
        raise DraftVocabError(f"{ENV}={v!r}: expected unset, 0, 'default' or an absolute path to an .npy")
    return p


def load_ids(path: Path, vocab_size: int | None = None):
    """Sorted unique int64 token ids from an .npy; raises DraftVocabError naming the problem."""
    import numpy as np

    if not path.is_file():
        raise DraftVocabError(f"{ENV}: {path} does not exist")
    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as e:
        raise DraftVocabError(f"{ENV}: {path} is not a readable .npy ({e})") from e
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise DraftVocabError(f"{ENV}: {path} must hold a non-empty 1-D integer array, "
                              f"got {arr.dtype} {arr.shape}")
    ids = arr.astype(np.int64)
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        raise DraftVocabError(f"{ENV}: ids must lie in [0, {vocab_size}); got [{ids.min()}, {ids.max()}]")
    uniq = np.unique(ids)
    if uniq.size != ids.size:
        raise DraftVocabError(f"{ENV}: {path} has {ids.size - uniq.size} duplicate ids")
    return uniq


class _Reduced:
    __slots__ = ("ids", "weight", "width")

    def __init__(self, ids, weight, width):
        self.ids, self.weight, self.width = ids, weight, width


_PASS = object()


def build_reduced(model, ids_np):
    """The reduced head for `model` (its `lm_head` and `logits_processor`) and the sorted id set:
    a private contiguous copy of the head's rows for the ids, or `_PASS` where the head is not a
    plain unsharded weight. compute_logits builds it on its first call; the per-step kernel bench
    (tools/bench_step_kernels.py) builds it the same way and times `reduced_logits` on it."""
    import torch

    head, proc = model.lm_head, model.logits_processor
    weight = getattr(head, "weight", None)
    plain = (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype.is_floating_point
             and getattr(head, "tp_size", 1) == 1 and not getattr(proc, "logits_as_input", False))
    if not plain:
        log.warning("flash_vllm: MTP reduced draft vocabulary off: the LM head is not a plain "
                    "unsharded weight (TP>1 or a quantized draft head); using the full head")
        return _PASS
    width = proc.org_vocab_size
    if int(ids_np.max()) >= width:
        raise DraftVocabError(f"{ENV}: id {int(ids_np.max())} is outside the vocabulary ({width})")
    ids = torch.as_tensor(ids_np, device=weight.device)
    sub = weight.index_select(0, ids).contiguous()
    mib = lambda n: n * weight.element_size() * weight.shape[1] / 2**20  # noqa: E731
    log.info("flash_vllm: MTP reduced draft vocabulary: %d of %d rows (%.0f -> %.0f MiB per draft step)",
             ids.numel(), width, mib(weight.shape[0]), mib(ids.numel()))
    return _Reduced(ids, sub, width)


def reduced_logits(state: _Reduced, proc, hidden_states):
    """One draft step's logits: the reduced GEMM, the processor's soft cap and scale, then the
    scatter into a full-width -inf tensor (what the patched compute_logits returns)."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(proc, "head_dtype", None) or hidden_states.dtype
    part = F.linear(hidden_states.to(dtype), state.weight.to(dtype))
    if proc.soft_cap is not None:
        part = torch.tanh(part / proc.soft_cap) * proc.soft_cap
    if proc.scale != 1.0:
        part = part * proc.scale
    out = part.new_full((*part.shape[:-1], state.width), float("-inf"))
    out.index_copy_(-1, state.ids, part)
    return out


_config: dict[str, object] = {}


def _wrap(orig):
    def compute_logits(self, hidden_states, spec_step_idx: int = 0):
        state = self.__dict__.get("_flash_draft_vocab")
        if state is None:
            ids = _config.get("ids")
            state = _PASS if ids is None else build_reduced(self, ids)
            self.__dict__["_flash_draft_vocab"] = state
        if state is _PASS:
            return orig(self, hidden_states, spec_step_idx)
        return reduced_logits(state, self.logits_processor, hidden_states)

    compute_logits.__doc__ = orig.__doc__
    return compute_logits


def check(ctx: Context) -> None:
    expect_source(*TARGET, "self.logits_processor(self.lm_head, hidden_states)")


def apply(ctx: Context) -> None:
    path = resolve_path(ctx.env.get(ENV))
    if path is not None:
        try:
            _config["ids"] = load_ids(path)
        except DraftVocabError as e:
            raise TargetMissing(str(e)) from e
        _config["path"] = str(path)
        log.info("flash_vllm: MTP reduced draft vocabulary enabled: %s (%d ids)", path, len(_config["ids"]))
    install(NUMBER, *TARGET, _wrap)


def verify(ctx: Context) -> None:
    expect_installed(NUMBER, *TARGET)


PATCH = Patch(
    number=NUMBER,
    name="mtp-draft-vocab",
    title="Reduced draft vocabulary for the MTP drafter",
    why=("Each MTP draft step multiplies by the full 248,320-row shared head. A 65,536-id slice "
         "cuts that GEMM ~4x; logits stay full width (-inf outside the set) so sampling, "
         "rejection and outputs are unchanged."),
    upstream="none (EAGLE3's draft_vocab_size is not wired to Qwen4ExpMTP; 0.33's "
             "draft_lm_head_quantization shrinks bytes, not rows)",
    gate=Gate(ENV, f"{ENV}=default|/abs/ids.npy",
              lambda e: e.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")),
    targets=(":".join(TARGET),),
    applies_to=releases.since("0.29.0"),
    check=check, apply=apply, verify=verify,
    untraced={ENV: ("patch 10's id set (a path) is read by Qwen4ExpMTP.compute_logits, which vLLM does not "
                    "compile; whether patch 10 applies is in `applied`")},
)
