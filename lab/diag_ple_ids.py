#!/usr/bin/env python3
"""Diagnose PLE n-gram ids on a GPU against the release's own CPU reference (issue 11).

Runs vLLM's fused `ple_ngram_ids` Triton kernel on CUDA the way `Qwen4ExpNGramEmbedding.forward`
does (profile-run shapes: one request of N tokens, EOS-filled context; and decode-like batches),
reads the ids back (a) right after the launch, as patch 1's host gather does, and (b) after a
device sync, and compares both with the release's torch path of `compute_ngram_ids` on CPU.
Prints one JSON line per case. Needs vLLM (e.g. the device payload's env) and a CUDA GPU."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def main() -> int:
    import torch
    import vllm
    from vllm.models.qwen4_exp.common.ops import ple as ops
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding as NG

    if not torch.cuda.is_available():
        print("diag_ple_ids: no CUDA device", file=sys.stderr)
        return 2
    print(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name()}))
    vocab, heads_per, ngram, eos = 512, 8, 3, 511
    mult = NG._make_layer_multipliers(ngram_size=ngram, unigram_vocab_size=vocab, seed=1234, ple_dense_layer_id=0)
    sizes, offs, total = NG._make_vocab_layout(ngram_vocab_size_base=1000, ngram_heads=16, ple_dense_layer_id=0)
    ref_self = SimpleNamespace(
        eos_token_id=eos, ngram_size=ngram, heads_per_ngram=heads_per,
        layer_multipliers=torch.tensor(mult), ngram_heads_vocab_sizes=torch.tensor(sizes),
        ngram_heads_offsets=torch.tensor(offs), _shift_precompute=NG._shift_precompute,
        _shift_apply=NG._shift_apply)
    dev = SimpleNamespace(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(ref_self).items()})
    g = torch.Generator().manual_seed(0)
    rc = 0
    for pdl in (None, False):
        if pdl is not None:
            ops.current_platform.is_arch_support_pdl = lambda: pdl  # noqa: E731 - diagnostic override
        for name, lens in (("profile-8192", [8192]), ("decode-8", [1] * 8), ("mixed", [37, 1, 1, 500, 3])):
            n = sum(lens)
            ids_in = torch.randint(0, vocab, (n,), generator=g)
            qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()))
            ctx = torch.full((len(lens), ngram - 1), eos, dtype=torch.long)
            want = NG.compute_ngram_ids(ref_self, ids_in, qsl, ctx)
            # Poison the allocator: the ids buffer reuses memory that held bf16 values.
            junk = torch.randn(n * 16 * 4, device="cuda", dtype=torch.bfloat16) * 1e-3
            del junk
            got = NG.compute_ngram_ids(dev, ids_in.cuda(), qsl.cuda(), ctx.cuda())
            early = got.to("cpu")
            torch.cuda.synchronize()
            late = got.to("cpu")
            res = {"case": name, "pdl": ops.current_platform.is_arch_support_pdl(), "tokens": n,
                   "rows": total, "early_equal": bool(torch.equal(early, want)),
                   "late_equal": bool(torch.equal(late, want)),
                   "early_out_of_range": int(((early < 0) | (early >= total)).sum()),
                   "late_out_of_range": int(((late < 0) | (late >= total)).sum())}
            if not res["late_equal"] or not res["early_equal"]:
                rc = 1
                bad = (late != want).nonzero()[:3].tolist()
                res["first_mismatches"] = [[i, j, int(late[i, j]), int(want[i, j])] for i, j in bad]
            print(json.dumps(res))
    return rc


if __name__ == "__main__":
    sys.exit(main())
