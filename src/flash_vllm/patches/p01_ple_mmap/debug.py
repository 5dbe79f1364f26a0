"""Patch 1's diagnostics (`VLLM_PLE_MMAP_DEBUG=1`): check every n-gram id the layer gathers.

`Qwen4ExpNGramEmbedding.forward` is wrapped so that, before the real forward runs, the release's
own `compute_ngram_ids` is called on the same inputs and its result is read back twice: at once
(as the host gather reads it) and after a device-wide sync. Both are compared with the release's
torch path of `compute_ngram_ids` run on CPU copies of the inputs and buffers (the reference).
One JSON log line per checked call (the first `LOG_FIRST` calls and every call that disagrees),
prefixed `flash_vllm patch 1 debug:`. Slow (two syncs and a host recomputation per layer and
step): for finding a fault, never for serving.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

log = logging.getLogger("vllm.flash")
LOG_FIRST = 4


def _reference_self(module):
    """A CPU stand-in carrying what the release's torch path of `compute_ngram_ids` reads."""
    return SimpleNamespace(
        eos_token_id=module.eos_token_id, ngram_size=module.ngram_size,
        heads_per_ngram=module.heads_per_ngram,
        layer_multipliers=module.layer_multipliers.detach().cpu(),
        ngram_heads_vocab_sizes=module.ngram_heads_vocab_sizes.detach().cpu(),
        ngram_heads_offsets=module.ngram_heads_offsets.detach().cpu(),
        _shift_precompute=type(module)._shift_precompute, _shift_apply=type(module)._shift_apply)


def check_ids(module, input_ids, query_start_loc, ngram_context, rows: int, calls: int) -> dict:
    """Compare the device ids (read at once and after a sync) with the CPU reference."""
    import torch

    cls = type(module)
    dev = cls.compute_ngram_ids(module, input_ids, query_start_loc, ngram_context)
    early = dev.to("cpu")
    if dev.is_cuda:
        torch.cuda.synchronize(dev.device)
    late = dev.to("cpu")
    ref = cls.compute_ngram_ids(_reference_self(module), input_ids.detach().cpu(),
                                query_start_loc.detach().cpu(), ngram_context.detach().cpu())

    def oob(t):
        return int(((t < 0) | (t >= rows)).sum())

    rep = {
        "call": calls, "layer": getattr(module.ngram_embedding, "_flash_layer", None), "rows": rows,
        "tokens": int(input_ids.numel()), "ids_shape": list(dev.shape), "ids_device": str(dev.device),
        "inputs": {n: [str(t.dtype), list(t.shape), str(t.device)]
                   for n, t in (("input_ids", input_ids), ("query_start_loc", query_start_loc),
                                ("ngram_context", ngram_context))},
        "buffers": {"sizes": module.ngram_heads_vocab_sizes.tolist(),
                    "offsets": module.ngram_heads_offsets.tolist(),
                    "multipliers": module.layer_multipliers.tolist()},
        "stream": str(torch.cuda.current_stream()) if dev.is_cuda else "cpu",
        "early_oob": oob(early), "late_oob": oob(late), "ref_oob": oob(ref),
        "early_equal_ref": bool(torch.equal(early, ref)), "late_equal_ref": bool(torch.equal(late, ref)),
        "early_equal_late": bool(torch.equal(early, late)),
    }
    if not rep["late_equal_ref"]:
        bad = (late != ref).nonzero()[:4].tolist()
        rep["mismatches"] = [[i, j, int(late[i, j]), int(ref[i, j])] for i, j in bad]
    return rep


def make_forward(original_forward):
    """`Qwen4ExpNGramEmbedding.forward` that checks its ids first (see the module doc)."""
    state = {"calls": 0}

    def forward(self, hidden_states, input_ids, query_start_loc, ngram_context):
        import torch

        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not capturing:
            state["calls"] += 1
            rows = int(getattr(self.ngram_embedding, "org_vocab_size", 0)) or int(self.ngram_embedding.weight.shape[0])
            rep = check_ids(self, input_ids, query_start_loc, ngram_context, rows, state["calls"])
            bad = rep["early_oob"] or rep["late_oob"] or not (rep["late_equal_ref"] and rep["early_equal_late"])
            if bad or state["calls"] <= LOG_FIRST:
                log.warning("flash_vllm patch 1 debug: %s", json.dumps(rep, sort_keys=True))
        return original_forward(self, hidden_states, input_ids, query_start_loc, ngram_context)

    return forward
