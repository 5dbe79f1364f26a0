#!/usr/bin/env python3
"""Patch 7 on real hardware: the rewritten QSA split-K Triton kernel with an e4m3 cache.

Usage (a CUDA machine with torch + triton; vLLM itself is not needed):
    python3 -m lab.prove_qsa_fp8_kv_gpu OPS_0.29 OPS_0.30 OPS_0.31 [--json OUT.json]
where OPS_X is that release's vllm/models/qwen4_exp/nvidia/ops/qsa.py. The three files are loaded
as modules over a stub `vllm` package holding only what they import (real triton, a platform
object, a copy of TritonWarmupTensor's compile-only metadata). Patch 7's `fp8_ops()` rewrites
0.29's and 0.30's kernel/launcher/warm-up exactly as it does inside vLLM. Per case:

- port fp8 (0.30) vs 0.31's native fp8, with 0.31 pinned to the same (GB300/sm_121) tile table
  (its sm_90 table is tuning): must be bitwise equal;
- port fp8 vs the fp32 torch reference over the dequantized cache: bf16-rounding close;
- port fp8 vs stock bf16 over the unquantized cache, against the e4m3 bound;
- the 0.30 warm-up of an fp8 (uint8) cache compiles every profile of the rewritten kernel;
- kernel time, stock bf16 vs port fp8, measured side by side (triton.testing.do_bench).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stub_vllm():
    import torch
    import triton
    import triton.language as tl

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []
        sys.modules[name] = m
        return m

    class Platform:
        device_type = "cuda"

        def get_device_capability(self):
            return tuple(torch.cuda.get_device_capability())

        def has_device_capability(self, cap):
            major, minor = self.get_device_capability()
            return major * 10 + minor >= cap

        def is_device_capability_family(self, fam):
            return self.get_device_capability()[0] * 10 == fam

    @dataclasses.dataclass
    class TritonWarmupTensor:  # the fields and methods of vLLM 0.30's compile-only tensor
        dtype: object
        aligned: bool = True
        shape: tuple = (1,)
        strides: tuple | None = None
        init: object = 0

        def data_ptr(self):
            return 0 if self.aligned else 1

        def ptr_range(self):
            return 0

        @property
        def device(self):
            return torch.device("cuda")

        def stride(self, dim=None):
            if self.strides is None:
                out, s = [], 1
                for size in reversed(self.shape):
                    out.append(s)
                    s *= size
                result = tuple(reversed(out))
            else:
                result = self.strides
            return result if dim is None else result[dim]

    mod("vllm")
    mod("vllm.platforms", current_platform=Platform())
    mod("vllm.triton_utils", HAS_TRITON=True, tl=tl, triton=triton)
    mod("vllm.model_executor")
    mod("vllm.model_executor.warmup")
    mod("vllm.model_executor.warmup.jit_warmup_triton_helper", TritonWarmupTensor=TritonWarmupTensor,
        triton_scalar_specialization_rep=lambda v: v)


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


# (rows, topk, scale, amplitude of K/V, use_prefill_config); rows x 2 KV heads = the tile-table key
CASES = [(1, 512, 1.0, 1.0, False), (4, 512, 0.1, 8.0, False), (48, 2048, 1.0, 2.0, False),
         (300, 1024, 0.1, 8.0, True), (1500, 512, 1.0, 1.0, True)]
SHAPE = dict(hq=16, hkv=2, d=256, page=16)


def cpu_bounds() -> int:
    """The references and the e4m3 output bound of every case, on the CPU (same generator, same
    inputs as the GPU run): |ref over e4m3 cache - ref over bf16 cache| <= bound."""
    import torch

    from tests.vllm.release import qsa_ref as ref

    bad = 0
    for rows, topk, scale, amp, _ in CASES:
        c = ref.make_case(rows=rows, blocks=512, topk=topk, seq=1600, amp=amp, seed=rows + topk, **SHAPE)
        d = SHAPE["d"]
        kb, vb = ref.split_cache(c["kv"], d)
        k8, v8 = (t.view(torch.float8_e4m3fn) for t in ref.split_cache(ref.quantize_e4m3(c["kv"], scale).view(torch.uint8), d))
        for name, idx, counted, gate in (("0.30", c["idx"], True, c["gate"]),
                                         ("0.29", c["idx"][:, :topk].contiguous(), False, None)):
            a = ref.sparse_paged_gqa(c["q"], kb, vb, idx, c["block_table"], c["token_to_req"], counted=counted, gate=gate)
            b = ref.sparse_paged_gqa(c["q"], k8, v8, idx, c["block_table"], c["token_to_req"], counted=counted,
                                     k_scale=scale, v_scale=scale, gate=gate)
            bound = ref.e4m3_output_bound(c["q"], kb, vb, k8, v8, idx, c["block_table"], c["token_to_req"],
                                          counted=counted, scale=scale)
            diff = (a - b).abs().amax(dim=-1)                    # per row and head
            within = bool(torch.all(diff <= bound))
            bad += not within
            print(json.dumps(dict(rows=rows, topk=topk, scale=scale, layout=name,
                                  ref_e4m3_vs_ref_bf16=float(diff.max()), max_abs_v=float(vb.float().abs().max()),
                                  bound_min=float(bound.min()), bound_max=float(bound.max()),
                                  slack_min=float((bound - diff).min()), within=within)), flush=True)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ops029", nargs="?")
    ap.add_argument("ops030", nargs="?")
    ap.add_argument("ops031", nargs="?")
    ap.add_argument("--json")
    ap.add_argument("--cpu-bounds", action="store_true", help="only the references and bounds, on the CPU")
    args = ap.parse_args()
    if args.cpu_bounds:
        return cpu_bounds()
    if not (args.ops029 and args.ops030 and args.ops031):
        ap.error("OPS_0.29 OPS_0.30 OPS_0.31 are required (or --cpu-bounds)")

    import torch
    import triton
    from triton.testing import do_bench

    stub_vllm()
    from tests.vllm.release import qsa_ref as ref
    from flash_vllm.patches.p07_qsa_fp8_kv import fp8_ops

    o29, o30, o31 = load(args.ops029, "ops029"), load(args.ops030, "ops030"), load(args.ops031, "ops031")
    o31._is_sm90 = lambda: False       # same tile table as 0.29/0.30 (and 0.31 on sm_121)
    o31._is_sm120 = lambda: False
    p29, p30 = fp8_ops(o29, "v0.29"), fp8_ops(o30, "v0.30")

    dev = "cuda"
    hq, hkv, d, page = SHAPE["hq"], SHAPE["hkv"], SHAPE["d"], SHAPE["page"]   # GQA group 8, head_dim 256
    results = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
               "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
               "shape": dict(hq=hq, hkv=hkv, d=d, page=page), "cases": [], "failures": []}
    fail = results["failures"]

    def mx(a, b):
        return float((a.float() - b.float()).abs().max())

    for rows, topk, scale, amp, use_prefill in CASES:
        try:
            c = ref.make_case(rows=rows, hq=hq, hkv=hkv, d=d, page=page, blocks=512, topk=topk, seq=1600,
                              amp=amp, seed=rows + topk, device=dev)
            kb, vb = ref.split_cache(c["kv"], d)
            kv8 = ref.quantize_e4m3(c["kv"], scale).view(torch.uint8)   # the uint8 cache vLLM allocates
            k8, v8 = (t.view(torch.float8_e4m3fn) for t in ref.split_cache(kv8, d))
            q, gate, idx, bt, t2r = c["q"], c["gate"], c["idx"], c["block_table"], c["token_to_req"]

            def run(fn, k, v, **kw):
                out = torch.empty_like(q)
                fn(q, k, v, idx, bt, t2r, use_prefill, out, output_gate=gate, **kw)
                return out

            bf16_030 = run(o30.qsa_sparse_paged_attention, kb, vb)
            fp8_030 = run(p30["attention"], k8, v8, k_scale=scale, v_scale=scale)
            fp8_031 = run(o31.qsa_sparse_paged_attention, k8, v8, k_scale=scale, v_scale=scale)
            bf16_031 = run(o31.qsa_sparse_paged_attention, kb, vb)
            ref_deq = ref.sparse_paged_gqa(q, k8, v8, idx, bt, t2r, counted=True, k_scale=scale, v_scale=scale,
                                           gate=gate)
            ref_orig = ref.sparse_paged_gqa(q, kb, vb, idx, bt, t2r, counted=True, gate=gate)
            # 0.29: no count column, no gate, its own tile table
            idx29 = idx[:, :topk].contiguous()
            bf16_029 = torch.empty_like(q)
            o29.qsa_sparse_paged_attention(q, kb, vb, idx29, bt, t2r, bf16_029)
            fp8_029 = torch.empty_like(q)
            p29["attention"](q, k8, v8, idx29, bt, t2r, fp8_029, k_scale=scale, v_scale=scale)
            ref29_deq = ref.sparse_paged_gqa(q, k8, v8, idx29, bt, t2r, counted=False, k_scale=scale, v_scale=scale)
            ref29_orig = ref.sparse_paged_gqa(q, kb, vb, idx29, bt, t2r, counted=False)

            vmax = float(vb.float().abs().max())
            # how far the e4m3 rounding of the cache may move the output (qsa_ref.e4m3_output_bound)
            # (the largest per-row bound; rows x heads in --cpu-bounds)
            e4m3_bound = float(ref.e4m3_output_bound(q, kb, vb, k8, v8, idx, bt, t2r, counted=True, scale=scale).max())
            e4m3_bound_029 = float(ref.e4m3_output_bound(q, kb, vb, k8, v8, idx29, bt, t2r, counted=False,
                                                         scale=scale).max())
            case = dict(rows=rows, topk=topk, scale=scale, amp=amp, use_prefill_config=use_prefill,
                        cfg_030=list(o30._select_config(rows, hkv, use_prefill, topk)),
                        port030_vs_native031_fp8=mx(fp8_030, fp8_031),
                        port030_bitwise_equal_native031=bool(torch.equal(fp8_030, fp8_031)),
                        stock030_bf16_vs_031_bf16=mx(bf16_030, bf16_031),
                        port030_vs_ref_dequant=mx(fp8_030, ref_deq), stock030_bf16_vs_ref=mx(bf16_030, ref_orig),
                        port030_fp8_vs_stock_bf16=mx(fp8_030, bf16_030), port030_fp8_vs_ref=mx(fp8_030, ref_orig),
                        port029_vs_ref_dequant=mx(fp8_029, ref29_deq), stock029_bf16_vs_ref=mx(bf16_029, ref29_orig),
                        port029_fp8_vs_ref=mx(fp8_029, ref29_orig), port029_fp8_vs_stock_bf16=mx(fp8_029, bf16_029),
                        max_abs_v=vmax, e4m3_bound=e4m3_bound, e4m3_bound_029=e4m3_bound_029)
            # bf16-rounding tolerance for kernel vs fp32 reference on the same (dequantized) values:
            # outputs are |o| <= max|V| (gated: times sigmoid <= 1), bf16 has 8 bits of mantissa.
            tol = 4 * 2 ** -8 * max(vmax, 1.0)
            if not case["port030_bitwise_equal_native031"]:
                fail.append(f"rows={rows}: 0.30 port != 0.31 native ({case['port030_vs_native031_fp8']})")
            for key in ("port030_vs_ref_dequant", "port029_vs_ref_dequant"):
                if not case[key] <= tol:
                    fail.append(f"rows={rows}: {key}={case[key]} > {tol}")
            for port, stock, bound in (("port030_fp8_vs_ref", "stock030_bf16_vs_ref", e4m3_bound),
                                       ("port029_fp8_vs_ref", "stock029_bf16_vs_ref", e4m3_bound_029)):
                if not case[port] <= case[stock] + bound + tol:
                    fail.append(f"rows={rows}: {port}={case[port]} beyond e4m3 bound {bound} + {case[stock]} + {tol}")
            # the patched dispatch keeps bf16 on the stock function (nothing else changes for bf16)
            if rows in (4, 1500):
                t_bf16 = do_bench(lambda: run(o30.qsa_sparse_paged_attention, kb, vb), warmup=25, rep=200)
                t_fp8 = do_bench(lambda: run(p30["attention"], k8, v8, k_scale=scale, v_scale=scale), warmup=25, rep=200)
                case.update(ms_stock030_bf16=t_bf16, ms_port030_fp8=t_fp8, fp8_over_bf16=t_fp8 / t_bf16)
            results["cases"].append(case)
            print(json.dumps(case), flush=True)
        except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
            import traceback
            fail.append(f"rows={rows}: {type(e).__name__}: {e}")
            traceback.print_exc()

    # the 0.30 warm-up on an fp8 (uint8) cache compiles every profile of the rewritten kernel
    kv_u8 = torch.zeros(64, hkv, page, 2 * d, dtype=torch.uint8, device=dev)
    bt = torch.zeros(8, 100, dtype=torch.int32, device=dev)
    t = time.monotonic()
    try:
        warmed = p30["warmup"](kv_u8, bt, num_query_heads=hq, selection_width=2048)
        results["warmup_030_fp8"] = {"profiles": [list(w) for w in warmed], "s": time.monotonic() - t}
    except Exception as e:  # noqa: BLE001 - recorded as a failure
        fail.append(f"warmup: {type(e).__name__}: {e}")
    print(json.dumps({"warmup_030_fp8": results.get("warmup_030_fp8"), "failures": fail}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 1 if fail else 0


if __name__ == "__main__":
    sys.exit(main())
