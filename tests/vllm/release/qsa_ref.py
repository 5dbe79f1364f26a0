"""Torch references for patch 7 (fp8 KV on QSA), shared by check_qsa_fp8_kv.py (CPU, in-release)
and lab/prove_qsa_fp8_kv_gpu.py (the Triton kernels on a GPU). Not a check file itself.

`sparse_paged_gqa` is what the QSA split-K kernel computes, written from its indexing rules:
row r attends to the selected logical tokens `idx[r, c]` (c < TOPK, and c < the trailing count
column on 0.30+), through the request's block table; -1 / out-of-table / out-of-cache entries
are skipped; a row with nothing valid outputs 0. 0.30+ multiply by sigmoid(gate) after rounding
the attention output to bf16.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def quantize_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What reshape_and_cache_flash writes for kv_cache_dtype fp8: x / scale, saturated, RNE."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def sparse_paged_gqa(q, k_cache, v_cache, idx, block_table, token_to_req, *, counted: bool,
                     k_scale: float = 1.0, v_scale: float = 1.0, gate=None) -> torch.Tensor:
    """q [R, Hq, D]; k_cache/v_cache [blocks, page, Hkv, D] (bf16 or e4m3); idx int32 [R, TOPK(+1)]."""
    rows, hq, d = q.shape
    blocks, page, hkv, _ = k_cache.shape
    topk = idx.shape[1] - (1 if counted else 0)
    sel = idx[:, :topk].long()
    valid = sel >= 0
    if counted:
        valid &= torch.arange(topk, device=q.device)[None, :] < idx[:, topk:].long()
    safe = sel.clamp(min=0)
    logical_page, offset = safe // page, safe % page
    req = token_to_req.long()
    nreq, width = block_table.shape
    valid &= ((req >= 0) & (req < nreq))[:, None] & (logical_page < width)
    phys = block_table[req.clamp(0, nreq - 1)[:, None], logical_page.clamp(max=width - 1)].long()
    valid &= (phys >= 0) & (phys < blocks)
    phys = phys.clamp(min=0)
    k = k_cache[phys, offset].float() * k_scale            # [R, T, Hkv, D]
    v = v_cache[phys, offset].float() * v_scale
    qf = q.float().view(rows, hkv, hq // hkv, d)
    s = torch.einsum("rhgd,rthd->rhgt", qf, k) * d ** -0.5
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)           # all-invalid rows -> 0
    o = torch.einsum("rhgt,rthd->rhgd", p, v).reshape(rows, hq, d)
    if gate is not None:
        o = o.to(torch.bfloat16).float() * torch.sigmoid(gate.float())
    return o


def make_case(*, rows: int, hq: int, hkv: int, d: int, page: int, blocks: int, topk: int,
              seq: int, amp: float, seed: int, device="cpu"):
    """Random QSA inputs: a bf16 cache [blocks, Hkv, page, 2D] (vLLM's layout before
    transpose/split), a shuffled block table, per-row distinct selections with -1 holes and a
    trailing count column."""
    g = torch.Generator().manual_seed(seed)
    nreq = max(1, min(rows, 4))
    pages_per_req = -(-seq // page)
    assert nreq * pages_per_req <= blocks
    perm = torch.randperm(blocks, generator=g)[: nreq * pages_per_req]
    block_table = perm.view(nreq, pages_per_req).to(torch.int32)
    kv = (torch.randn(blocks, hkv, page, 2 * d, generator=g) * amp).to(torch.bfloat16)
    q = torch.randn(rows, hq, d, generator=g).to(torch.bfloat16)
    gate = torch.randn(rows, hq, d, generator=g).to(torch.bfloat16)
    token_to_req = (torch.arange(rows) % nreq).to(torch.int32)
    idx = torch.full((rows, topk + 1), -1, dtype=torch.int32)
    for r in range(rows):
        n = int(torch.randint(1, min(topk, seq) + 1, (1,), generator=g))
        chosen = torch.randperm(seq, generator=g)[:n].to(torch.int32)
        holes = torch.rand(n, generator=g) < 0.1
        chosen[holes] = -1
        idx[r, :n] = chosen
        idx[r, topk] = n
    return {k: v.to(device) for k, v in dict(q=q, kv=kv, gate=gate, idx=idx, block_table=block_table,
                                              token_to_req=token_to_req).items()}


def split_cache(kv: torch.Tensor, d: int):
    """forward_qsa's view: [blocks, Hkv, page, 2D] -> K, V as [blocks, page, Hkv, D]."""
    return kv.transpose(1, 2).split(d, dim=-1)


def _gather(cache, idx, block_table, token_to_req, *, counted: bool):
    """cache rows each selected slot reads (and the validity mask), as in sparse_paged_gqa."""
    blocks, page = cache.shape[:2]
    topk = idx.shape[1] - (1 if counted else 0)
    sel = idx[:, :topk].long()
    valid = sel >= 0
    if counted:
        valid &= torch.arange(topk, device=idx.device)[None, :] < idx[:, topk:].long()
    safe = sel.clamp(min=0)
    nreq, width = block_table.shape
    req = token_to_req.long()
    valid &= ((req >= 0) & (req < nreq))[:, None] & (safe // page < width)
    phys = block_table[req.clamp(0, nreq - 1)[:, None], (safe // page).clamp(max=width - 1)].long()
    valid &= (phys >= 0) & (phys < blocks)
    return cache[phys.clamp(min=0), safe % page].float(), valid


def e4m3_output_bound(q, k16, v16, k8, v8, idx, block_table, token_to_req, *, counted: bool,
                      scale: float) -> torch.Tensor:
    """Per (row, query head): how far the attention output may move when the cache is replaced
    by its e4m3 rounding (dequantized with `scale`).

    With o = sum_i p_i v_i over the row's valid selected tokens: |o8 - o16| <= max_i |dv_i| +
    max_i |v_i| * (exp(2 max_i |ds_i|) - 1), where ds_i = q . dk_i / sqrt(D) is the score change
    and dv_i the value change: moving every score by at most max|ds| scales each softmax weight by
    a factor within e^{+-2 max|ds|}. The output gate (sigmoid <= 1) only shrinks it. Rows with
    nothing valid output 0 on both paths (bound 0).
    """
    rows, hq, d = q.shape
    hkv = k16.shape[2]
    g = hq // hkv
    k_a, valid = _gather(k16, idx, block_table, token_to_req, counted=counted)
    k_b, _ = _gather(k8, idx, block_table, token_to_req, counted=counted)
    v_a, _ = _gather(v16, idx, block_table, token_to_req, counted=counted)
    v_b, _ = _gather(v8, idx, block_table, token_to_req, counted=counted)
    qf = q.float().view(rows, hkv, g, d)
    ds = torch.einsum("rhgd,rthd->rhgt", qf, k_b * scale - k_a).abs() * d ** -0.5
    ds = ds.masked_fill(~valid[:, None, None, :], 0.0).amax(dim=-1)            # [R, Hkv, G]
    m = valid[:, :, None, None]
    dv = ((v_b * scale - v_a).abs() * m).amax(dim=(1, 3))                       # [R, Hkv]
    vmax = (v_a.abs() * m).amax(dim=(1, 3))
    bound = dv[:, :, None] + vmax[:, :, None] * torch.expm1(2 * ds)
    return bound.reshape(rows, hq)
