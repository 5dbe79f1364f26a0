"""`flash plan`: the memory budget before a ten-minute boot.

    budget   = device_total × GPU_MEM                         (vllm/v1/worker/utils.py::request_memory)
    non-KV   = weights + top-k buffers + activations(BATCHED_TOKENS) + runtime overhead (calibrated)
    KV bytes = KV_CACHE_MEM if set, else budget − non-KV        (gpu_worker.determine_available_memory)
    tokens   = kvcache.layout(...).tokens(KV bytes)             (what "GPU KV cache size" prints)
    host     = MemTotal − vLLM's claim − OS reserve − vLLM's pre-snapshot processes → page cache

Everything but the runtime overhead is derived from the geometry, the checkpoint headers and
vLLM's source; the overhead is fitted once on the published default-recipe pool (calibration.py)
and every other published figure is a check. docs/PLAN.md has the derivation and the table.

Public API (doctor and status use these): `build(settings, hardware, snapshot=...)`, `deployed(...)`
(the same for a PARALLEL deployment), `doctor_findings(settings)`, `status_comparison(settings, kv_log_line)`.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any

from flash_common import releases

from .. import geometry as geometry_mod
from ..spec import ple_hoisted
from . import hardware as hardware_mod
from . import kvcache, prefill, prefix, weights as weights_mod, workspace
from .calibration import (DISCRETE_OVERHEAD_BAND, DISCRETE_OVERHEAD_BAND_FULL, H200_RUN, H200_RUN_FULL, OVERHEAD_BAND,
                          REAL_SHAPE_BOOTS, REAL_SHAPE_RUN, RUNTIME_OVERHEAD, RUNTIME_OVERHEAD_DISCRETE,
                          RUNTIME_OVERHEAD_DISCRETE_FULL, RUNTIME_SHAPE_EXTRA)
from .hardware import GIB, Hardware

# What vLLM's profiler counts beyond weights, activations and top-k buffers, fitted on the GB10
# (unified memory) and, apart, on a discrete card (the H200) per graph regime: each constant's name
# (fitting.py re-solves them by setting this module's attribute), its boot-to-boot band and the run
# it was fitted on (None: the published GB10 figures).
OVERHEAD_FITS = {
    "RUNTIME_OVERHEAD": (OVERHEAD_BAND, None),
    "RUNTIME_OVERHEAD_DISCRETE": (DISCRETE_OVERHEAD_BAND, H200_RUN),
    "RUNTIME_OVERHEAD_DISCRETE_FULL": (DISCRETE_OVERHEAD_BAND_FULL, H200_RUN_FULL),
}


def overhead_constant(s, hw: Hardware) -> str:
    """The fitted overhead that applies: the GB10's on unified memory; on a discrete card, the one of
    the graph regime the run spec renders (FULL_AND_PIECEWISE where the PLE gather is hoisted)."""
    if hw.unified:
        return "RUNTIME_OVERHEAD"
    return "RUNTIME_OVERHEAD_DISCRETE_FULL" if ple_hoisted(s) else "RUNTIME_OVERHEAD_DISCRETE"


PLE_TABLE_NOTE = "PLE table: mmapped from the checkpoint by the plugin (patch 1), 0 bytes on the GPU; it lives in the page cache"


def _gib(x: float | int | None) -> float | None:
    return None if x is None else round(x / GIB, 3)


def activation_bytes(g: geometry_mod.Geometry, batched_tokens: int) -> int:
    """Transient peak of the profile run (a BATCHED_TOKENS-token prefill), estimated from the
    largest tensors alive together: the HC streams (in, out, mix), one MoE layer's top-k
    intermediates (w13 out, activation, down out) and the QSA projections; plus a constant 128
    MiB, first taken for 0.29's QSA logits chunk, which the profile run never allocates (it builds
    no attention metadata: workspace.py); the fitted overheads absorb the constant, so it stays
    rather than move them. An estimate: its error at 8192 tokens is absorbed by the calibrated
    overhead, it only sets how the budget moves with BATCHED_TOKENS."""
    hc = 3 * g.hc_width * 2
    moe = g.num_experts_per_tok * (3 * g.moe_intermediate_size + g.hidden_size) * 2
    qsa = (2 * g.num_attention_heads * g.head_dim + 2 * g.num_key_value_heads * g.head_dim
           + (g.indexer_n_heads + g.indexer_kv_heads) * g.indexer_head_dim) * 2
    return batched_tokens * (hc + moe + qsa) + 128 * 1024**2


# CUDA graphs captured above vLLM's own size hold more memory, which vLLM counts before it sizes the
# KV pool: latency48 run2 (32 real-shape layers, an H100) logged 1.08 GiB of graphs captured to 832
# tokens against 0.31 GiB to 48, and a pool 3.6% smaller. That is ~1.0 MiB a token above vLLM's
# size, taken here as a multiple of the model's per-token activation bytes so that it follows the
# shape. An estimate from one pair of boots: every fitted constant ran at vLLM's own size.
GRAPH_MEASURED_BYTES, GRAPH_MEASURED_TOKENS = int((1.08 - 0.31) * 1024**3), 832 - 48


def graph_extra_bytes(s, g: geometry_mod.Geometry, extra_words: list[str]) -> int:
    """The graph memory a capture size above vLLM's own adds (GRAPH_TOKENS, or a size the compilation
    flags set); 0 at vLLM's own size or below."""
    got = prefill.capture_max(s, extra_words)
    above = 0 if got is None else got - prefill.vllm_capture(s["SEQS"], s["MTP"], s["BATCHED_TOKENS"])
    if above <= 0:
        return 0
    base = 128 * 1024**2  # activation_bytes' constant, not per token
    per_token = (activation_bytes(g, 1) - base) / (activation_bytes(geometry_mod.Geometry(), 1) - base)
    return int(GRAPH_MEASURED_BYTES / GRAPH_MEASURED_TOKENS * per_token * above)


# vLLM's profile run encodes dummy images of the processor's largest size before the text forward;
# the larger peak counts. Not modelled apart: estimated on CPU (benchmarks/encoder-peak-cpu).
ENCODER_NOTE = {
    True: "vision encoder: vLLM's profile also runs the tower on one image of the processor's largest size "
          "(16,384 tokens at Qwen3-VL's bounds: ~1.5-1.8 GiB, estimated on CPU) and counts the larger of its "
          "peak and the text forward's; not modelled apart (the GB10 fit, tower loaded, carries it)",
    False: "vision tower not loaded (--language-model-only in EXTRA): its weights and its profile peak (one "
           "largest image, ~1.5-1.8 GiB estimated) are gone, and the GB10 fit carries that peak: the pool may "
           "come out larger than planned",
}


def topk_buffer_bytes(g: geometry_mod.Geometry, batched_tokens: int, qsa_layers: int) -> int:
    """`Qwen4ExpQSAAttention.topk_indices_buffer`: int32 [max_num_batched_tokens,
    budget + ratio] per QSA layer (drafter included), allocated at model init."""
    return qsa_layers * batched_tokens * (g.indexer_budget + g.indexer_compress_ratio) * 4


def _extra_words(extra: str | None) -> list[str]:
    try:
        return shlex.split(extra or "")
    except ValueError:
        return []


def _vision_loaded(extra: str | None) -> bool:
    return "--language-model-only" not in _extra_words(extra)


def _extra_value(extra: str | None, flag: str) -> str | None:
    """The value of `FLAG V` or `FLAG=V` in EXTRA (the last one wins, as in argparse)."""
    words, out = _extra_words(extra), None
    for i, w in enumerate(words):
        if w == flag and i + 1 < len(words):
            out = words[i + 1]
        elif w.startswith(flag + "="):
            out = w.split("=", 1)[1]
    return out


def extra_block_size(extra: str | None) -> int | None:
    """`--block-size N` in EXTRA: vLLM takes it as the floor and alignment of the hybrid block
    size (`Platform._align_hybrid_block_size`)."""
    val = _extra_value(extra, "--block-size")
    return int(val) if val and val.isdigit() and int(val) > 0 else None


def flashinfer_gdn(extra: str | None, hw: Hardware) -> tuple[bool, str | None]:
    """(whether the GDN prefill runs on FlashInfer, the EXTRA value that decided it): 0.33's
    `_resolve_gdn_prefill_backend` picks FlashInfer on `auto` where the hardware has it; any
    other named backend (`--gdn-prefill-backend triton`, offline without cubins) exports no
    prefill checkpoints, so the block is not aligned to 64."""
    val = _extra_value(extra, "--gdn-prefill-backend")
    if val is None or val.lower() == "auto":
        return hw.flashinfer_gdn, val
    return val.lower() == "flashinfer", val


def served_dir(settings, snapshot: Path | None) -> tuple[Path | None, bool]:
    """(directory whose headers describe what vLLM loads, whether it is the prepared variant)."""
    if snapshot is None:
        return None, False
    from .. import hfcache

    mode = settings["MODE"]
    if mode == "nvfp4":
        return snapshot, True
    if (snapshot / hfcache.MARKER).exists():  # given a prepared variant directory itself (--config)
        return snapshot, True
    if hfcache.variant_state(snapshot, mode) == "ready":
        return hfcache.variant_dir(snapshot, mode), True
    return snapshot, False  # not built (or stale): the snapshot's headers, converted on paper


def resolve_snapshot(settings) -> Path | None:
    from .. import hfcache

    return hfcache.resolve_snapshot(Path(os.path.expanduser(settings["HF_CACHE"])), settings["MODEL"],
                                    settings["REVISION"])


def ple_table_placement(s, snapshot: Path | None) -> tuple[bool, str]:
    """(is the PLE table in GPU memory, the assumption that says so): patch 1 serves it from disk
    (FP8 rows and NVFP4 codes alike; preflight refuses a base with no path) unless it is off."""
    from ..spec import ple_patch_off

    if ple_patch_off(s):
        return True, "PLE table: patch 1 is off (CONTAINER_ENV), so vLLM holds the table in memory"
    return False, PLE_TABLE_NOTE


def build(settings, hw: Hardware, *, snapshot: Path | None | bool = True, hw_how: str = "",
          live_checks: bool = True, split: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    """The plan as plain data. `snapshot=True` looks the checkpoint up in HF_CACHE, a Path uses
    it (a checkpoint directory, or its config.json), None/False plans from the known geometry.
    `split` = (tp, pp): the plan of ONE rank of a deployment that splits the model over tp × pp
    boxes (each box's own budget, KV pool and page cache; plan/parallel.py)."""
    s = settings
    assumptions: list[str] = []
    if snapshot is True:
        snapshot = resolve_snapshot(s)
    snapshot = snapshot or None
    if snapshot is not None and Path(snapshot).is_file():
        snapshot = Path(snapshot).parent
    geom = geometry_mod.REAL
    if snapshot is not None and (snapshot / "config.json").is_file():
        try:
            geom = geometry_mod.from_config(snapshot / "config.json")
            assumptions.append(f"geometry from {snapshot / 'config.json'}")
        except (OSError, ValueError) as exc:
            assumptions.append(f"config.json unreadable ({exc}); geometry of the published checkpoint")
    else:
        assumptions.append("geometry of the published checkpoint (its config.json's text_config, built into geometry.py); no snapshot on disk")

    tp, pp = split
    ranks = tp * pp
    whole = geom
    if ranks > 1:
        geom = geometry_mod.per_rank(whole, tp, pp)
        assumptions.append(f"one rank of {ranks} (tensor {tp} × pipeline {pp}): its KV layout from its own share "
                           f"({geom.num_key_value_heads} of {whole.num_key_value_heads} QSA KV heads, "
                           f"{geom.linear_num_value_heads} of {whole.linear_num_value_heads} GDN value heads, "
                           f"{geom.num_hidden_layers} of {whole.num_hidden_layers} layers); weights split evenly "
                           "(first order: replicated norms, gates and biases are well under 1% of them)")
    base, mtp, mode = s["BASE"], s["MTP"], s["MODE"]
    vision = _vision_loaded(s["EXTRA"])
    draft_vocab = s["DRAFT_VOCAB"] != "0"
    kind = weights_mod.checkpoint_kind(s["MODEL"], snapshot)
    table_on_gpu, table_note = ple_table_placement(s, snapshot)
    w = None
    directory, prepared = served_dir(s, snapshot)
    if directory is not None:
        try:
            w = weights_mod.from_headers(directory, whole, mode=mode, mtp=mtp, draft_vocab=draft_vocab,
                                         vision=vision, prepared=prepared, table_on_gpu=table_on_gpu)
        except (OSError, ValueError) as exc:
            assumptions.append(f"checkpoint headers unreadable ({exc}); weights from the geometry")
    if w is None:
        w = weights_mod.geometry_estimate(whole, checkpoint=kind, mode=mode, mtp=mtp, draft_vocab=draft_vocab,
                                          vision=vision, table_on_gpu=table_on_gpu)
        assumptions.append(f"weights from the geometry for a {kind} checkpoint in MODE={mode}")
    assumptions += w.notes
    assumptions.append(table_note)
    assumptions.append(ENCODER_NOTE[vision])
    # patch 10's copy is held outside the budget (below); none where TP splits the head (it passes through)
    head = w.outside_budget // ranks if tp == 1 else 0
    if head:
        assumptions.append(f"reduced draft head: a private 65,536-row bf16 slice of lm_head ({_gib(head)} GiB), "
                           "held outside the budget: the drafter's first compute_logits makes it after the peak of "
                           "vLLM's profile run, which counts peak less end, so the pool is the same with or without "
                           "it (measured: recipe48 run7, benchmarks/plan-real-shape)")

    user_block = extra_block_size(s["EXTRA"])
    fi_gdn, gdn_flag = flashinfer_gdn(s["EXTRA"], hw)
    if gdn_flag is not None:
        assumptions.append(f"--gdn-prefill-backend {gdn_flag} in EXTRA: GDN prefill on "
                           f"{'FlashInfer' if fi_gdn else 'a non-FlashInfer kernel (no prefill checkpoints)'}")
    try:
        lay = kvcache.layout(geom, base=base, kv_dtype=s["KV_DTYPE"], mtp=mtp, prefix_cache=s["PREFIX_CACHE"],
                             max_model_len=s["CTX"], flashinfer_gdn=fi_gdn, user_block_size=user_block)
    except ValueError as exc:  # vLLM refuses the same geometry at boot
        from ..errors import ConfigError

        ring = -(-(geom.indexer_compress_ratio + mtp) // geom.indexer_compress_ratio) * geom.indexer_compress_ratio
        raise ConfigError(f"vLLM would refuse this KV layout: {exc}",
                          hint=f"add --block-size N to EXTRA with N a multiple of {math.lcm(ring, kvcache.KERNEL_BLOCK)} "
                               "(the QSA ring capacity and the kernel block)") from None
    assumptions += lay.notes
    if user_block:
        assumptions.append(f"--block-size {user_block} in EXTRA: vLLM aligns the hybrid block size to it "
                           f"(block {lay.block_size})")
    qsa_layers = geom.qsa_layers + (geom.mtp_num_hidden_layers if mtp else 0)
    batched = s["BATCHED_TOKENS"]
    act = activation_bytes(geom, batched)
    topk = topk_buffer_bytes(geom, batched, qsa_layers)
    full_graphs = ple_hoisted(s)  # the run spec renders FULL_AND_PIECEWISE for it, PIECEWISE otherwise
    constant = overhead_constant(s, hw)
    # at the real layers a discrete card's constant gets the real-shape term (the tiny fixtures fitted it)
    shape_extra = globals()["RUNTIME_SHAPE_EXTRA"] if not hw.unified and geometry_mod.real_layer_shape(whole) else 0
    overhead = globals()[constant] + shape_extra  # read at call time: fitting.py re-solves them by name
    overhead_band, fit_run = OVERHEAD_FITS[constant]
    requested = -(-int(hw.device_total * s["GPU_MEM"] * 1000) // 1000)  # math.ceil(total × util)
    w_total = (w.total - w.outside_budget) // ranks  # this rank's share, inside the budget
    extra_words = _extra_words(s["EXTRA"])
    graphs_extra = graph_extra_bytes(s, geom, extra_words)
    non_kv = w_total + act + topk + overhead + graphs_extra
    if graphs_extra:
        who = "the compilation flags" if prefill.graph_source(s, extra_words) == "flags" else f"GRAPH_TOKENS={s['GRAPH_TOKENS']}"
        assumptions.append(f"{who}: CUDA graphs captured to "
                           f"{prefill.capture_max(s, extra_words):,} tokens, above vLLM's own "
                           f"{prefill.vllm_capture(s['SEQS'], s['MTP'], s['BATCHED_TOKENS']):,}, hold "
                           f"~{_gib(graphs_extra)} GiB more, taken from the KV pool (an estimate from one pair of "
                           "boots at 32 layers on an H100: 0.77 GiB more for 832 against 48, latency48-h100 run2)")
    if s["KV_CACHE_MEM"]:
        kv_bytes = int(s["KV_CACHE_MEM"])
        claim = non_kv + kv_bytes
        assumptions.append("KV_CACHE_MEM set: vLLM skips the profiling budget and takes it as the KV size")
        band = (kv_bytes, kv_bytes)
    else:
        kv_bytes = requested - non_kv
        claim = requested
        band = (kv_bytes - overhead_band, kv_bytes + overhead_band)
    tokens = lay.tokens(kv_bytes)
    conc = lay.concurrency(kv_bytes)
    one_request = lay.bytes_for_requests(1, s["CTX"])
    # taken by the first prefill after the KV pool was sized, kept by the caching allocator
    logits = workspace.qsa_logits_bytes(base, s["CTX"], lay.block_size, geom.indexer_compress_ratio, batched)
    outside = logits + head

    host: dict[str, Any] = {"unified_memory": hw.unified}
    table = w.on_disk.get("ple_table") or geom.ple_table_bytes  # the checkpoint's own (NVFP4 in the QAD export)
    page_cache = None
    if hw.unified and hw.host_total:
        page_cache = hw.host_total - claim - outside - hw.host_reserve - hw.vllm_baseline
        host.update(host_total_gib=_gib(hw.host_total), vllm_claim_gib=_gib(claim), outside_budget_gib=_gib(outside),
                    os_reserve_gib=_gib(hw.host_reserve), vllm_pre_snapshot_gib=_gib(hw.vllm_baseline))
    elif hw.host_total:
        page_cache = hw.host_total - hw.host_reserve - 6 * GIB
        host.update(host_total_gib=_gib(hw.host_total), note="discrete GPU: the host pool is separate from vLLM's budget")
    host.update(page_cache_for_ple_gib=_gib(page_cache), ple_table_gib=_gib(table),
                ple_table_cached_fraction=None if page_cache is None else round(max(page_cache, 0) / table, 3))
    assumptions.append(f"device total {_gib(hw.device_total)} GiB × GPU_MEM {s['GPU_MEM']} = the budget"
                       + (f" ({'; '.join(hw.evidence)})" if hw.evidence else ""))
    if not hw.unified:
        assumptions.append("discrete GPU: vLLM's budget is device memory only; the PLE table's page cache is host "
                           "RAM, separate from it" + ("" if hw.host_total else " (host RAM unknown for a preset: "
                                                      "plan on the machine itself to see it)"))
    if hw.unified:
        assumptions.append(f"host: OS + Docker reserve {_gib(hw.host_reserve)} GiB and vLLM's processes before its "
                           f"first memory snapshot {_gib(hw.vllm_baseline)} GiB are outside GPU_MEM (assumed)")
    if hw.unified:
        assumptions.append(f"runtime overhead {_gib(overhead)} GiB (CUDA context, graphs, non-torch buffers): fitted on "
                           f"the published default-recipe pool; boot-to-boot spread ±{_gib(overhead_band)} GiB")
    else:
        regime = "hoisted gather, FULL_AND_PIECEWISE graphs" if full_graphs else "eager gather, PIECEWISE graphs"
        how = (f"{_gib(overhead - shape_extra)} GiB fitted on the warm boots of the tiny fixtures alone on an H200 "
               f"({fit_run}); the band ±{_gib(overhead_band)} GiB covers a cold first boot")
        if shape_extra:
            fitted = ", ".join(f"{words[0]} at {layers} real layers on an {card.upper()}"
                               for _, layers, card, words, _ in REAL_SHAPE_BOOTS)
            how += (f"; plus {_gib(shape_extra)} GiB at the model's own layers, fitted on {len(REAL_SHAPE_BOOTS)} boots "
                    f"({fitted}; the hoisted gather) and held out on the others ({REAL_SHAPE_RUN})"
                    + ("" if full_graphs else "; the eager gather was not booted at the real shape: carried over"))
        else:
            how += "; not the real model's layers, so the real-shape term is not added"
        assumptions.append(f"runtime overhead {_gib(overhead)} GiB (graphs, non-torch buffers; the discrete-GPU fit "
                           f"for the {regime}): {how}")
    assumptions.append("cold Triton autotune cache: a first boot (a fresh install, an upgrade, a new shape) "
                       "autotunes inside vLLM's profile, which then holds do_bench's 256 MiB buffer: up to 0.25 GiB "
                       "less KV on that boot only (the discrete fits are on warm boots)")
    if hw.unified and full_graphs:  # the graph regime the run spec will pass
        assumptions.append("graphs FULL_AND_PIECEWISE (PLE_MODE resolves to the hoisted gather): the unified-memory "
                           "fit was measured with PIECEWISE graphs; on the H200 this regime's non-KV memory came out "
                           "0.46 GiB smaller (run43 vs run37), so the pool may come out larger than planned")
    assumptions.append(f"outside the budget: the QSA indexer's float32 logits, up to {_gib(logits)} GiB from the "
                       f"first prefill on (the most at CTX={s['CTX']:,}, BATCHED_TOKENS={batched:,}; {base}: "
                       f"{workspace.describe(base)}); vLLM's profile run builds no attention metadata, so it never "
                       "sees them")
    assumptions.append("the QSA logits come on top of what else a prefill step holds at the indexer, which may stay "
                       "under the profiled activation peak or pass it: counted whole, so the page-cache figure is the "
                       "low end (sizes from each release's own function run on CPU; not measured on a GPU)")
    if not releases.has(base, "overhead_fitted"):
        assumptions.append(f"accounting of {base}: same allocator path as 0.29 except where noted; the overhead "
                           "was fitted on pools measured with the 0.29-era image")

    plan = {
        "profile": getattr(s, "profile_name", None),
        "hardware": {"name": hw.name, "desc": hw.desc, "how": hw_how or ("preset" if not hw.detected else "detected"),
                     "device_total_gib": _gib(hw.device_total), "unified_memory": hw.unified, "sm": hw.sm},
        "recipe": {k: s[k] for k in ("MODEL", "MODE", "BASE", "CTX", "MTP", "KV_DTYPE", "GPU_MEM", "KV_CACHE_MEM",
                                      "SEQS", "BATCHED_TOKENS", "PREFIX_CACHE", "DRAFT_VOCAB")},
        "kv_cache_tokens": tokens,
        "kv_cache_tokens_range": [lay.tokens(band[0]), lay.tokens(band[1])],
        "kv_bytes_per_token": round(lay.bytes_per_token(), 1),
        "kv_bytes_per_token_effective": round(kv_bytes / tokens, 1) if tokens > 0 else None,
        "kv_cache_gib": _gib(kv_bytes),
        "weights_gib": _gib(w_total),
        "max_concurrency": round(conc, 3),
        "max_concurrency_at": s["CTX"],
        "one_request_at_ctx_gib": _gib(one_request),
        "fits": kv_bytes > 0 and conc >= 1 and (page_cache is None or page_cache >= 0),
        "weights": {"source": w.source, "gib": {k: _gib(v) for k, v in w.components.items() if v},
                    "checkpoint_on_disk_gib": {k: _gib(v) for k, v in w.on_disk.items() if v}},
        "budget": {"gpu_mem": s["GPU_MEM"], "requested_gib": _gib(requested), "weights_gib": _gib(w_total),
                   "activations_gib": _gib(act), "topk_buffers_gib": _gib(topk), "runtime_overhead_gib": _gib(overhead),
                   "graphs_above_vllm_gib": _gib(graphs_extra),
                   "non_kv_gib": _gib(non_kv), "kv_cache_gib": _gib(kv_bytes), "kv_cache_mem_set": bool(s["KV_CACHE_MEM"]),
                   "outside_budget_gib": _gib(outside), "qsa_logits_outside_gib": _gib(logits),
                   "draft_head_outside_gib": _gib(head)},
        "kv_layout": {
            "accounting": f"vLLM {base} hybrid allocator (packed block-outermost groups)",
            "block_size": lay.block_size, "attention_page_bytes_per_token": lay.attn_page_per_token,
            "mamba_page_bytes": lay.mamba_page_unpadded, "padded_page_bytes": lay.block_size * lay.attn_page_per_token,
            "ring_capacity": lay.ring_capacity, "kv_dtype_bytes": lay.kv_dtype_bytes,
            "caches": lay.per_cache(),
            "groups": [{"layers": g.describe(), "bytes_per_block": g.bytes,
                        "blocks_per_request": g.blocks_per_request(s["CTX"])} for g in lay.groups],
            "bytes_per_block": lay.bytes_per_block, "blocks_per_request_at_ctx": lay.blocks_per_request,
            "num_blocks": lay.num_blocks(kv_bytes),
        },
        "prefix_cache": prefix.plan(s, lay.block_size),
        "long_prefill": prefill.plan(s, lay.block_size, extra_words),
        "host": host,
        "assumptions": assumptions,
    }
    plan["findings"] = findings(plan, s, hw, live_checks)
    return plan


def _hybrid_possible(s) -> bool:
    from ..checkpoint import known

    lay = known.for_model(s["MODEL"])
    return s["MODE"] == "nvfp4" and (lay is None or "hybrid" in lay.modes)


def findings(plan: dict, s, hw: Hardware, live_checks: bool = True) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    b, tokens, conc = plan["budget"], plan["kv_cache_tokens"], plan["max_concurrency"]
    if b["kv_cache_gib"] <= 0:
        out.append(("fail", f"cannot fit: weights {b['weights_gib']} GiB + runtime {round(b['non_kv_gib'] - b['weights_gib'], 2)} GiB "
                            f"exceed the GPU_MEM={s['GPU_MEM']} budget of {b['requested_gib']} GiB; raise GPU_MEM"
                            + (" or use MODE=hybrid" if _hybrid_possible(s) else "")))
    elif conc < 1:
        out.append(("fail", f"cannot fit one CTX={s['CTX']} request: it needs {plan['one_request_at_ctx_gib']} GiB of KV, the pool "
                            f"has {b['kv_cache_gib']} GiB (~{tokens:,} tokens); vLLM refuses to start. Lower CTX, raise GPU_MEM "
                            "or use KV_DTYPE=fp8_e4m3"))
    host = plan["host"]
    pc = host.get("page_cache_for_ple_gib")
    if pc is not None and pc < 0:
        out.append(("fail", f"vLLM's claim ({host.get('vllm_claim_gib')} GiB) plus the OS leaves {pc} GiB of the "
                            f"{host.get('host_total_gib')} GiB pool: the host will swap; lower GPU_MEM or KV_CACHE_MEM"))
    elif pc is not None:
        minimum = s["PAGE_CACHE_MIN"] / GIB
        if pc < minimum:
            out.append(("warn", f"only {pc} GiB of page cache is left for the {host['ple_table_gib']} GiB PLE table "
                                f"(PAGE_CACHE_MIN={round(minimum, 1)} GiB): prefill will fault on the disk; lower GPU_MEM"))
    if live_checks and hw.host_available is not None and hw.unified and not s["KV_CACHE_MEM"] and b["requested_gib"] * GIB > hw.host_available:
        out.append(("fail", f"GPU_MEM={s['GPU_MEM']} asks for {b['requested_gib']} GiB but only "
                            f"{_gib(hw.host_available)} GiB is available now: vLLM refuses at start; free memory or lower GPU_MEM"))
    uneven = plan.get("long_prefill") and prefill.finding(plan["long_prefill"])
    if uneven:
        out.append(uneven)
    outside = plan.get("long_prefill") and prefill.graph_finding(plan["long_prefill"], s)
    if outside:
        out.append(outside)
    if conc >= 1 and s["SEQS"] > conc:
        out.append(("info", f"the pool holds {conc:.2f} requests of CTX={s['CTX']:,} tokens; SEQS={s['SEQS']} only runs "
                            "concurrently for shorter requests"))
    if not any(level == "fail" for level, _ in out):
        out.append(("ok", f"memory plan: KV pool ~{tokens:,} tokens ({conc:.2f}× CTX), weights {plan['weights_gib']} GiB"
                          + (f", {pc} GiB of page cache for the PLE table" if pc is not None else "")))
    return out


def deployed(settings, hw: Hardware, **kw) -> dict[str, Any]:
    """build() for what the recipe deploys. One box, dp and pd (every box a whole server): the plan
    of one box, plus the deployment view under "parallel". tp/pp layouts split the model, so one box
    alone is not what runs: the findings are each box's (its share of the weights, its pool) and
    "rank" holds that box's plan, whose KV tokens are what each rank's vLLM logs."""
    plan = build(settings, hw, **kw)
    if settings["PARALLEL"] == "none":
        return plan
    from .. import layout
    from . import parallel

    lay = layout.parse(settings["PARALLEL"])
    rank = build(settings, hw, **kw, split=(lay.tp, lay.pp)) if lay.rendezvous else None
    plan["parallel"] = parallel.plan(plan, lay, rank)
    if rank is not None:
        plan["rank"] = rank
        plan["findings"] = [(level, f"each box: {text}") for level, text in rank["findings"]]
    return plan


def doctor_findings(settings, hw: Hardware | None = None) -> list[tuple[str, str]]:
    """(level, text) for `flash doctor`: levels ok / warn / fail / info. The live MemAvailable
    check is left to doctor's own host section (it runs it with the same numbers)."""
    if hw is None:
        hw, _ = hardware_mod.detect()
    return deployed(settings, hw, live_checks=False)["findings"]


def status_comparison(settings, kv_log_line: str, hw: Hardware | None = None) -> str:
    """The boot log's "GPU KV cache size: N tokens" next to the prediction, with the error."""
    from ..kvline import compare

    return compare(*prediction(settings, hw)[:3], kv_log_line)


def prediction(settings, hw: Hardware | None = None) -> tuple[int, int, int, str, float | None]:
    """(predicted tokens, low, high, hardware name, GiB left to the page cache): what `flash
    serve` stores in a label (status compares MemAvailable with the last one)."""
    if hw is None:
        hw, _ = hardware_mod.detect()
    whole = deployed(settings, hw)
    plan = whole.get("rank", whole)  # a tp/pp rank logs its own pool
    lo, hi = plan["kv_cache_tokens_range"]
    return plan["kv_cache_tokens"], lo, hi, hw.name, plan["host"].get("page_cache_for_ple_gib")
