#!/usr/bin/env python3
"""Decode tok/s at the real model's shape (issue 12): stock vs PIECEWISE + eager PLE gather vs
FULL + hoisted PLE gather, at concurrency 1/4/8 with MTP=2, on vLLM with `--load-format dummy`.

Steps (benchmarks/decode-h200/README.md has the exact sequence for the H200):

  prepare DIR [--quant nvfp4|fp8] [--ple-rows full|N]
      DIR/model: the real config.json (every text_config field of
      ../shared/reference/model-and-checkpoints.md spelled out), the quantization config, small
      tokenizer/processor files; DIR/ple: a PLE table written by flash's writer (real row width
      160 fp8 bytes, 16 heads, 128 shards; full = 320,001,536 rows = 47.68 GiB, or N rows with
      `ngram_vocab_size_base` lowered to match so every hashed id is in range, said in meta.json).
      --quant nvfp4: the nvidia checkpoint's MIXED_PRECISION config (NVFP4 experts). --quant fp8:
      the same with the routed experts as FP8_PB_WO (block 128, the MTP experts' own format), for a
      GPU whose vLLM cannot run NVFP4 MoE (Hopper); ~113 GiB of experts, fits 139 GiB.
  plan DIR [--port P]       the three server configurations (env + argv), as JSON
  serve-run DIR CONFIG --out FILE.jsonl [--levels 1,4,8] [--tokens 256] [--repeats 3]
      start `vllm serve` for CONFIG (stock | eager | hoisted), wait for /health, measure, stop it;
      one JSON line per measurement appended to FILE (raw; nothing averaged away).
  run URL --label L --out FILE.jsonl   measure a server someone else started
  plot FILE.jsonl... --out PNG          medians per config and concurrency, ratios vs stock, and
                                       the paired ratios pooled with a 95% interval (`paired`)
  greedy URL --out FILE.json / greedy-diff A.json B.json
      exactness: fixed token-id prompts (EOS inside, a long one for chunked prefill, a repeat and a
      shared prefix for prefix-cache hits), greedy token ids; the diff exits 1 at the first change

Each request: a distinct random token-id prompt (64 ids, no shared prefix), `max_tokens` tokens with
`ignore_eos` (random weights would stop at random lengths), greedy, streamed. Aggregate tok/s = all
completion tokens / (last end - first send); per-stream tok/s = (tokens - 1) / (end - first chunk).
MTP acceptance comes from the server's spec-decode counters around each measurement. With random
weights the draft rarely agrees, so the acceptance length is ~1: the step shapes (3 tokens per
request per step) match serving with MTP=2, the tokens per step do not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flash_vllm.metrics_bridge import interval_s as bridge_interval_s  # noqa: E402 (stdlib only)
from flash_vllm.ple.stats import COUNTERS as PLE_COUNTERS  # noqa: E402 (stdlib only)
from flash_common.provenance import tree_commit  # noqa: E402 (stdlib only)

P = "model.language_model."
LAYERS, EXPERTS, HIDDEN, MOE_INTER, VOCAB = 48, 512, 2560, 640, 248_320
TOPK, MTP = 10, 2  # experts per token (num_experts_per_tok); draft tokens the servers run with
SIDE_PARAMS = 60e6  # attention or GDN + shared expert + router per layer (memory_estimate's figure)
EXPERT_BYTES = {"nvfp4": 0.5 + 1 / 16, "fp8": 1.0 + 4 / (128 * 128)}  # per parameter, block scales included
FULL_NGRAM_BASE = 20_000_000
CONFIGS = ("stock", "eager", "hoisted")
# opt-in variants (`--configs`): hoisted with the Stager's dedup threshold of run6 (256), where
# c=8 x MTP=2 = 384 rows took the dedup side; the default (1025) keeps every decode batch up to the
# Stager's graph limit (1,024 rows) on the short path
VARIANTS = {"hoisted-dedup256": ("hoisted", {"VLLM_PLE_MMAP_DEDUP_MIN": "256"})}
ALL_CONFIGS = CONFIGS + tuple(VARIANTS)
GPU_GIB = 139  # the H200's memory as the device machine reports it


def is_qsa(i: int) -> bool:
    return i % 4 == 3


def check_layers(layers: int) -> int:
    """The real model's 3:1 GDN/QSA pattern repeats every 4 layers; the PLE layer (id 2) needs >= 3."""
    if layers < 4 or layers > LAYERS or layers % 4:
        raise SystemExit(f"--layers {layers}: give a multiple of 4 from 4 to {LAYERS} (the 3 GDN + 1 QSA pattern)")
    return layers


def text_config(ngram_base: int, layers: int = LAYERS) -> dict:
    """Every field of the real text_config (reference §1), none left to transformers' defaults;
    `layers` < 48 keeps every per-layer shape and the pattern, with fewer repeats (said in meta.json)."""
    return {
        "model_type": "qwen4_exp_text", "hidden_size": HIDDEN, "num_hidden_layers": layers,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4), "full_attention_interval": 4,
        "vocab_size": VOCAB, "max_position_embeddings": 262144,
        "num_attention_heads": 24, "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "output_gate_type": "sigmoid",
        "mamba_ssm_dtype": "float32",
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
        "hc_count": 4, "hc_lowrank": 320,
        "num_experts": EXPERTS, "num_experts_per_tok": 10, "moe_intermediate_size": MOE_INTER,
        "shared_expert_intermediate_size": 640, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "ple_layer_ids": [2], "ple_embed_dim": 2560, "ple_conv_kernel_size": 4, "ngram_size": 3,
        "heads_per_ngram": 8, "ngram_vocab_size_base": ngram_base, "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 128,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "mtp": {"hybrid": True, "layer_types": ["full_attention"], "num_hidden_layers": 1, "rope_theta": 10000000,
                "mtp_use_hidden_state_from_layer": None},
        "bos_token_id": 248044, "eos_token_id": 248044, "pad_token_id": None,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "initializer_range": 0.02,
        "dtype": "bfloat16", "use_cache": True,
    }


def quant_config(quant: str, layers: int = LAYERS) -> tuple[dict, dict]:
    """(config.json's quantization_config, hf_quant_config.json): the nvidia checkpoint's
    MIXED_PRECISION layout; --quant fp8 turns the routed experts into FP8_PB_WO (block 128)."""
    producer = {"name": "modelopt", "version": "0.46.0"}
    algo = {"nvfp4": {"quant_algo": "NVFP4", "group_size": 16},
            "fp8": {"quant_algo": "FP8_PB_WO", "group_size": 128}}[quant]
    quantized = {f"{P}layers.{i}.mlp.experts": dict(algo) for i in range(layers)}
    quantized[f"{P}layers.1.ple.ple_embedding.ngram_embedding"] = {"quant_algo": "FP8"}
    ignore = ["lm_head", f"{P}embed_tokens", "model.visual*"] + [
        f"{P}layers.{i}.{m}*" for i in range(layers)
        for m in (("self_attn",) if is_qsa(i) else ("linear_attn",)) + ("mlp.shared_expert",)]
    qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "producer": producer,
          "quantized_layers": {**quantized, "mtp.layers.0.mlp.experts": {"quant_algo": "FP8_PB_WO", "group_size": 128}},
          "ignore": ignore}
    hq_layers = {k: ({"quant_algo": "FP8_BLOCK_SCALES", "group_size": 128} if v.get("quant_algo") == "FP8_PB_WO" else v)
                 for k, v in qc["quantized_layers"].items()}
    hq = {"producer": producer, "quantization": {"quant_algo": "MIXED_PRECISION", "exclude_modules": ignore,
                                                 "quantized_layers": hq_layers}}
    return qc, hq


def memory_estimate(quant: str, layers: int = LAYERS) -> dict:
    """Weight bytes in GiB (experts dominate), to check a config fits before a boot."""
    expert_params = layers * EXPERTS * 3 * HIDDEN * MOE_INTER
    bytes_per = EXPERT_BYTES[quant]
    gib = 1 << 30
    experts = expert_params * bytes_per / gib
    mtp_experts = EXPERTS * 3 * HIDDEN * MOE_INTER * (1 + 4 / 128 ** 2) / gib
    side = layers * 60e6 * 2 / gib  # attention/GDN/shared expert/router/HC per layer, bf16 (~60M params)
    embed = 2 * VOCAB * HIDDEN * 2 / gib
    return {"experts_gib": round(experts, 1), "mtp_experts_gib": round(mtp_experts, 1),
            "side_layers_gib": round(side, 1), "embed_lm_head_gib": round(embed, 1),
            "total_gib": round(experts + mtp_experts + side + embed, 1)}


ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
         "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
         "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
         "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
         "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
         "<tts_text_bos_single>", "<|audio_pad|>")  # 248044.. (reference: the tokenizer section)
FIRST_ADDED = 248_044


PX = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
      "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 4096, "longest_edge": 65536}}


def tokenizer_json() -> dict:
    """A word-level tokenizer with one entry for every one of the 248,320 ids (`<t123>`) and Qwen's
    33 added tokens at their real ids: the server can detokenize any id the random model emits
    (the real BPE vocabulary is not needed: prompts are token ids, text is never read)."""
    vocab = {f"<t{i}>": i for i in range(VOCAB)}
    for i, name in enumerate(ADDED):
        del vocab[f"<t{FIRST_ADDED + i}>"]
        vocab[name] = FIRST_ADDED + i
    added = [{"id": FIRST_ADDED + i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": name.startswith("<|")} for i, name in enumerate(ADDED)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<t0>"}}


def ngram_base_for(rows: int) -> int:
    """ngram_vocab_size_base whose 16 heads sum to about `rows` rows."""
    return max(3, rows // 16)


def prepare(args) -> int:
    from flash_vllm.ple import synth
    from flash_vllm.ple.hashing import PLELayout

    out = Path(args.dir)
    base = FULL_NGRAM_BASE if args.ple_rows == "full" else ngram_base_for(int(args.ple_rows))
    layers = check_layers(args.layers)
    text = text_config(base, layers)
    layout = PLELayout.from_config(text)
    table_bytes = layout.num_rows * layout.head_dim
    free = shutil.disk_usage(out.parent if not out.exists() else out).free
    mem = memory_estimate(args.quant, layers)
    mem["stock_with_table_on_gpu_gib"] = round(mem["total_gib"] + table_bytes / (1 << 30), 1)
    print(json.dumps({"ple_rows": layout.num_rows, "ple_gib": round(table_bytes / (1 << 30), 2),
                      "disk_free_gib": round(free / (1 << 30), 1), "weights": mem}))
    if mem["stock_with_table_on_gpu_gib"] > GPU_GIB:
        print(f"warning: the stock run puts the table on the GPU: ~{mem['stock_with_table_on_gpu_gib']} GiB of "
              f"weights > {GPU_GIB} GiB; use a smaller --ple-rows for all three runs", file=sys.stderr)
    if table_bytes + (1 << 30) > free:
        raise SystemExit(f"--ple-rows {args.ple_rows}: the table needs {table_bytes / (1 << 30):.1f} GiB, "
                         f"{free / (1 << 30):.1f} GiB free at {out}; give a smaller --ple-rows (e.g. 32000000)")
    model, ple = out / "model", out / "ple"
    model.mkdir(parents=True, exist_ok=True)
    qc, hq = quant_config(args.quant, layers)
    cfg = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
           "tie_word_embeddings": False, "text_config": text, "quantization_config": qc,
           "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
           "vision_end_token_id": 248054,
           "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                             "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2,
                             "temporal_patch_size": 2, "deepstack_visual_indexes": [], "model_type": "qwen4_exp"}}
    files = {
        "config.json": cfg, "hf_quant_config.json": hq,
        "generation_config.json": {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044},
        # prompts are token ids; the server still detokenizes every generated id
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                                  "pad_token": "<|endoftext|>"},
        # the processors transformers maps qwen4_exp to (as the tiny fixtures that booted on the H200)
        "preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor", **PX},
        "video_preprocessor_config.json": {"video_processor_type": "Qwen3VLVideoProcessor", **PX, "fps": 2,
                                           "min_frames": 2, "max_frames": 8},
    }
    for name, obj in files.items():
        (model / name).write_text(json.dumps(obj, indent=None if name == "tokenizer.json" else 1))
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    rps = layout.rows_per_shard
    last = layout.num_rows - rps * (layout.num_shards - 1)
    t0 = time.monotonic()
    if not (ple / "model.safetensors.index.json").exists():
        synth.write_checkpoint(ple, layout="nvidia", rows_per_shard=rps, num_shards=layout.num_shards,
                               last_rows=last, width=layout.head_dim, scale=0.03125, finite=True)
    meta = {"quant": args.quant, "layers": layers, "ple_rows": layout.num_rows, "ngram_vocab_size_base": base,
            "full_table": args.ple_rows == "full", "ple_write_s": round(time.monotonic() - t0, 1),
            "weights_estimate": mem,
            "layers_note": ("all 48 layers" if layers == LAYERS else
                            f"{layers} of the real 48 layers ({layers // 4} repeats of 3 GDN + 1 QSA; every per-layer "
                            "shape, the PLE layer, the MTP layer, embeddings and lm_head real)"),
            "note": ("full 320,001,536-row table" if args.ple_rows == "full" else
                     f"reduced table: ngram_vocab_size_base {base} (real: {FULL_NGRAM_BASE}) so ids stay in range; "
                     "real row width (160 fp8 bytes) and heads (16)")}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta))
    return 0


def server_plan(d: Path, port: int, side_by_side: bool = False) -> dict:
    """The three servers and the opt-in VARIANTS: env + argv. Common: dummy weights, MTP=2, 8
    sequences, short context. side_by_side: ports port, port+1, ... (CONFIGS then VARIANTS) and a
    fixed 4 GiB KV pool each (no memory profiling, so boots at once cannot starve each other), for
    `matrix`; else one at a time at 0.95."""
    mem = ["--gpu-memory-utilization", "0.30", "--kv-cache-memory-bytes", str(4 << 30)] if side_by_side else \
        ["--gpu-memory-utilization", "0.95"]

    def common(i: int) -> list[str]:
        return ["vllm", "serve", str(d / "model"), "--load-format", "dummy", "--served-model-name", "bench",
                "--port", str(port + i if side_by_side else port), "--max-model-len", "4096", "--max-num-seqs", "8",
                *mem, "--block-size", "256", "--no-enable-prefix-caching",
                "--language-model-only",  # no vision tower, no image profiling: decode is text only
                "--max-num-batched-tokens", "2048",
                "--gdn-prefill-backend", "triton",
                "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2}, separators=(",", ":"))]
    base_env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    ple_env = {**base_env, "VLLM_PLE_MMAP": "1", "VLLM_PLE_MMAP_DIR": str(d / "ple")}

    def cc(mode):
        # decode batches here are <= 8 requests x 3 tokens: capture up to 32 tokens (a shorter boot)
        return ["--compilation-config", json.dumps({"cudagraph_mode": mode, "max_cudagraph_capture_size": 32},
                                                   separators=(",", ":"))]

    plans = {
        # the ceiling: the release's own storage with the whole table on the GPU, vLLM's default graphs
        # (patch 1 off explicitly: the plugin is installed in all three; the other patches are alike)
        "stock": {"env": {**base_env, "VLLM_PLE_MMAP": "0"},
                  "argv": common(0) + ["--engram-config", '{"cpu_offload":false}'] + cc("FULL_AND_PIECEWISE")},
        "eager": {"env": {**ple_env, "VLLM_PLE_MMAP_MODE": "eager"}, "argv": common(1) + cc("PIECEWISE")},
        "hoisted": {"env": {**ple_env, "VLLM_PLE_MMAP_MODE": "hoisted"}, "argv": common(2) + cc("FULL_AND_PIECEWISE")},
    }
    # a variant: its base's server with more env, on the next port
    head = len(common(0))
    return plans | {name: {"env": {**plans[base]["env"], **env}, "argv": common(len(plans) + i) + plans[base]["argv"][head:]}
                    for i, (name, (base, env)) in enumerate(VARIANTS.items())}


def plan_cmd(args) -> int:
    print(json.dumps(server_plan(Path(args.dir).resolve(), args.port), indent=1))
    return 0


def _metric(url: str, names: tuple[str, ...]) -> dict:
    """The named series' sums (exact sample names; flash_cli.api.metric_sums, checked against
    prometheus_client in the unit tier), zeros when the server cannot be read."""
    import requests

    from flash_cli.api import metric_sums

    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return {n: 0.0 for n in names}
    return {n: 0.0 for n in names} | metric_sums(text, names)


SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")
# patch 1's counters (flash_vllm.ple.stats.COUNTERS, as counter samples), on the API server's
# /metrics through the metrics bridge, which rewrites them at most once an interval (1 s by
# default): read after a settle of that interval and a margin
PLE = {k.removesuffix("_s"): PLE_COUNTERS[k][0] + "_total"
       for k in ("ops", "op_s", "gpu_wait_s", "dedup_s", "gather_s", "stage_s", "rows")}
PLE_SETTLE_S = bridge_interval_s({}) + 0.5


def ple_phases(before: dict, after: dict) -> dict | None:
    """Patch 1's lookups during one measurement: ops, and per op the ms of each phase and the rows
    (None when the server made none: stock, or counters not exposed)."""
    ops = after.get(PLE["ops"], 0.0) - before.get(PLE["ops"], 0.0)
    if ops <= 0:
        return None
    per = {f"{k}_ms_per_op": round((after.get(n, 0.0) - before.get(n, 0.0)) * 1000.0 / ops, 4)
           for k, n in PLE.items() if k not in ("ops", "rows")}
    return {"ops": int(ops), **per, "rows_per_op": round((after.get(PLE["rows"], 0.0) - before.get(PLE["rows"], 0.0)) / ops, 1)}


def _one(url: str, prompt: list[int], tokens: int, rec: dict) -> None:
    import requests

    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    rec["sent"] = time.perf_counter()
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"].get("completion_tokens")
                if chunk.get("choices") and rec.get("first") is None:
                    rec["first"] = time.perf_counter()
    except requests.RequestException as exc:
        rec["error"] = str(exc)[:200]
    rec["end"] = time.perf_counter()


def measure(url: str, label: str, levels: list[int], tokens: int, repeats: int, sink) -> None:
    import random

    rng = random.Random(12)
    for rep in range(repeats):
        for conc in levels:
            measure_one(url, label, conc, tokens, rep, rng, sink)


def _streams(url: str, conc: int, tokens: int, rng, prompt_len: int = 64) -> list[dict]:
    """`conc` requests at once, each a distinct random `prompt_len`-id prompt drawn from `rng` and
    `tokens` greedy tokens; one timing record per stream (_one's)."""
    recs = [{} for _ in range(conc)]
    threads = [threading.Thread(target=_one, args=(url, [rng.randrange(1000, 240000) for _ in range(prompt_len)], tokens,
                                                   recs[i]))
               for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return recs


def measure_one(url: str, label: str, conc: int, tokens: int, rep: int, rng, sink, extra: dict | None = None,
                settle_s: float = 0.0, prompt_len: int = 64) -> dict:
    """One measurement (`_streams`, the spec-decode and PLE counters read around it): one raw row.
    `settle_s`: wait that long after the streams before the second read, so the PLE counters the
    metrics bridge carries (at most once a second) hold all of this measurement's lookups; the
    first read needs no wait when the server's previous measurement or warm-up settled too."""
    names = SPEC + tuple(PLE.values())
    before = _metric(url, names)
    recs = _streams(url, conc, tokens, rng, prompt_len)
    if settle_s:
        time.sleep(settle_s)
    after = _metric(url, names)
    errors = [r["error"] for r in recs if "error" in r]
    row = {"label": label, "concurrency": conc, "repeat": rep, "max_tokens": tokens, "time": time.time(), **(extra or {})}
    if errors:
        row["error"] = errors[0]
    else:
        total = sum(r.get("tokens") or 0 for r in recs)
        wall = max(r["end"] for r in recs) - min(r["sent"] for r in recs)
        per = [((r["tokens"] or 0) - 1) / (r["end"] - r["first"]) for r in recs
               if r.get("first") and r["end"] > r["first"] and (r.get("tokens") or 0) > 1]
        drafts = after[SPEC[0]] - before[SPEC[0]]
        acc = after[SPEC[1]] - before[SPEC[1]]
        row.update(aggregate_tok_s=total / wall, per_stream_tok_s=statistics.median(per) if per else None,
                   tokens=total, wall_s=wall, ttft_s=statistics.median([r["first"] - r["sent"] for r in recs]),
                   mtp_drafts=drafts, mtp_accepted=acc, mtp_acceptance_length=(1 + acc / drafts) if drafts else None)
        ple = ple_phases(before, after)
        if ple:
            row["ple"] = ple
    sink(row)
    print(json.dumps(row), flush=True)
    return row


def warm(url: str, label: str, conc: int, tokens: int, sink, extra: dict | None = None, settle_s: float = 0.0,
         prompt_len: int = 64) -> None:
    """`conc` streams of `tokens` tokens, untimed for the results: one `warmup` event row (its wall
    time kept raw, so a slow first round shows), never summarized or paired. `settle_s` after it, as
    measure_one's: the first measurement's PLE counters then hold none of the warm-up's lookups."""
    import random

    rng = random.Random(7)  # its own prompts: the timed ones stay the same with or without it
    recs = _streams(url, conc, tokens, rng, prompt_len)
    if settle_s:
        time.sleep(settle_s)
    row = {"label": label, "event": "warmup", "concurrency": conc, "max_tokens": tokens, **(extra or {}),
           "wall_s": round(max(r["end"] for r in recs) - min(r["sent"] for r in recs), 3)}
    errors = [r["error"] for r in recs if "error" in r]
    if errors:
        row["error"] = errors[0]
    sink(row)
    print(json.dumps(row), flush=True)


def _sink(path: str):
    def write(row: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return write


def _levels(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--levels {text!r}: give comma-separated integers, e.g. 1,4,8") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"--levels {text!r}: give comma-separated integers >= 1, e.g. 1,4,8")
    return vals


def _wait_health(url: str, proc, timeout: float) -> None:
    import requests

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited with {proc.returncode} before /health")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise SystemExit(f"no /health after {timeout:.0f} s")


def serve_run(args) -> int:
    d = Path(args.dir).resolve()
    spec = server_plan(d, args.port)[args.config]
    url = f"http://127.0.0.1:{args.port}"
    log = open(args.log or f"{args.out}.{args.config}.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_health(url, proc, args.boot_timeout)
        boot = time.monotonic() - t0
        meta = {"label": args.config, "event": "booted", "boot_s": round(boot, 1), "argv": spec["argv"], "env": spec["env"]}
        _sink(args.out)(meta)
        print(json.dumps(meta), flush=True)
        measure(url, args.config, _levels(args.levels), args.tokens, args.repeats, _sink(args.out))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return 0


def _stop(procs: dict) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    end = time.monotonic() + 60
    for proc in procs.values():
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _commit() -> str:
    """The tree measured (FLASH_E2E_COMMIT, else this checkout's short HEAD), as the e2e tier names it."""
    return tree_commit(ROOT, short=True)


def _configs(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in ALL_CONFIGS]
    if bad or not names or len(set(names)) < len(names):
        raise SystemExit(f"--configs {text!r}: give a comma-separated subset of {', '.join(ALL_CONFIGS)}, each once")
    return names


def matrix(args) -> int:
    """All configurations booted side by side (fixed KV pools), then measured one server at a time:
    at each concurrency the configs back to back, the order rotated every repeat and level, so a
    pair compared by `paired` shares one window of this machine's noise; idle servers do not touch
    the GPU. Raw rows carry the model's layer count (meta.json)."""
    import random

    d = Path(args.dir).resolve()
    meta = json.loads((d / "meta.json").read_text())
    configs, levels = _configs(args.configs), _levels(args.levels)
    plan = server_plan(d, args.port, side_by_side=True)
    sink = _sink(args.out)
    logs = Path(args.logs or Path(args.out).parent)
    logs.mkdir(parents=True, exist_ok=True)
    extra = {"layers": meta.get("layers", LAYERS), "quant": meta.get("quant"), "ple_rows": meta.get("ple_rows"),
             "commit": _commit()}  # every raw row names the tree it measured
    t0, deadline = time.monotonic(), time.monotonic() + args.deadline
    procs, urls, booted = {}, {}, {}
    try:
        for c in configs:
            spec = plan[c]
            port = int(spec["argv"][spec["argv"].index("--port") + 1])
            urls[c] = f"http://127.0.0.1:{port}"
            log = open(logs / f"{c}-L{extra['layers']}.log", "w")  # noqa: SIM115 - the child owns it
            procs[c] = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            time.sleep(3)
        import requests

        while len(booted) < len(procs) and time.monotonic() < min(deadline, t0 + args.boot_timeout):
            for c, proc in procs.items():
                if c in booted:
                    continue
                if proc.poll() is not None:
                    booted[c] = None
                    tail = (logs / f"{c}-L{extra['layers']}.log").read_text(errors="replace")[-1500:]
                    row = {"label": c, "event": "boot_failed", "exit": proc.returncode, "tail": tail, **extra}
                    sink(row)
                    print(json.dumps(row), flush=True)
                    continue
                try:
                    up = requests.get(urls[c] + "/health", timeout=3).status_code == 200
                except requests.RequestException:
                    up = False
                if up:
                    booted[c] = round(time.monotonic() - t0, 1)
                    row = {"label": c, "event": "booted", "boot_s": booted[c], "argv": plan[c]["argv"],
                           "env": plan[c]["env"], **extra}
                    sink(row)
                    print(json.dumps(row), flush=True)
            time.sleep(2)
        live = [c for c in configs if booted.get(c)]
        for c in configs:
            if c not in booted:
                sink({"label": c, "event": "boot_timeout", **extra})
        # patch 1's servers: their PLE counters settle after each round (stock has none to wait for)
        settle = {c: (args.ple_settle if c != "stock" else 0.0) for c in live}
        if args.warmup_tokens:
            # one untimed round per config and level first: run5's first repeat was the slowest for
            # every config (the first batch of each size pays one-time costs), hoisted's most
            for c in live:
                for conc in levels:
                    if time.monotonic() < deadline:
                        warm(urls[c], c, conc, args.warmup_tokens, sink, extra, settle[c])
        rngs = {c: random.Random(12) for c in live}  # each config sees the same prompts in the same order
        for rep in range(args.repeats):
            # concurrency-major: the configs at one level run back to back, so each pair paired()
            # compares shares a window of the machine's noise; the order rotates every repeat
            for j, conc in enumerate(levels):
                turn = (rep + j) % len(live) if live else 0
                for c in live[turn:] + live[:turn]:
                    if time.monotonic() > deadline:
                        sink({"event": "deadline", "repeat": rep, "at_s": round(time.monotonic() - t0, 1), **extra})
                        return 0 if live else 1
                    measure_one(urls[c], c, conc, args.tokens, rep, rngs[c], sink, extra, settle[c])
        return 0 if live == configs else 1
    finally:
        _stop(procs)


def run_cmd(args) -> int:
    measure(args.url.rstrip("/"), args.label, _levels(args.levels), args.tokens, args.repeats, _sink(args.out))
    return 0


def greedy_cases(eos: int, vocab: int, seed: int = 7) -> list[tuple[str, list[int]]]:
    """Fixed token-id prompts: short ones, EOS inside (the n-gram context resets there), a long one
    (chunked prefill under a small --max-num-batched-tokens), the same long one again (a prefix-cache
    hit when caching is on) and one sharing its first 1,024 tokens."""
    import random

    rng = random.Random(seed)
    hi = min(vocab, 240_000)
    lo = min(1000, hi // 2)

    def ids(n):
        return [rng.randrange(lo, hi) for _ in range(n)]

    long = ids(3000)
    eos_in = ids(20)
    eos_in[5] = eos_in[12] = eos
    return [("short-1", ids(8)), ("short-2", ids(33)), ("eos-inside", eos_in), ("eos-last", ids(15) + [eos]),
            ("long", long), ("long-again", list(long)), ("shared-prefix", long[:1024] + ids(200))]


def greedy_cmd(args) -> int:
    import requests

    url = args.url.rstrip("/")
    model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    out = {"url": url, "model": model, "max_tokens": args.tokens, "cases": []}
    for name, prompt in greedy_cases(args.eos, args.vocab):
        body = {"model": model, "prompt": prompt, "max_tokens": args.tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        r = requests.post(url + "/v1/completions", json=body, timeout=600)
        if r.status_code != 200:
            raise SystemExit(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
        choice = r.json()["choices"][0]
        if choice.get("token_ids") is None:
            raise SystemExit(f"{name}: the server returned no token_ids (return_token_ids unsupported?)")
        out["cases"].append({"name": name, "prompt_len": len(prompt), "token_ids": choice["token_ids"]})
        print(f"{name}: {len(prompt)} prompt tokens -> {choice['token_ids'][:8]}...", flush=True)
    Path(args.out).write_text(json.dumps(out))
    return 0


def greedy_diff(args) -> int:
    a, b = (json.loads(Path(f).read_text()) for f in (args.a, args.b))
    if [c["name"] for c in a["cases"]] != [c["name"] for c in b["cases"]]:
        raise SystemExit("the two files hold different cases")
    for ca, cb in zip(a["cases"], b["cases"]):
        for i, (x, y) in enumerate(zip(ca["token_ids"], cb["token_ids"])):
            if x != y:
                print(f"DIFFER {ca['name']}: token {i}: {x} vs {y}")
                return 1
        if len(ca["token_ids"]) != len(cb["token_ids"]):
            print(f"DIFFER {ca['name']}: {len(ca['token_ids'])} vs {len(cb['token_ids'])} tokens")
            return 1
    print(f"identical: {len(a['cases'])} cases, {sum(len(c['token_ids']) for c in a['cases'])} tokens")
    return 0


def key(r: dict) -> str:
    """A row's series: its config, and the layer count when the row has one (`matrix`)."""
    return f"{r['label']}/L{r['layers']}" if r.get("layers") else r["label"]


def stock_of(series: str) -> str:
    return "stock" + (series[series.index("/"):] if "/" in series else "")


def summarize(rows: list[dict]) -> dict:
    """{series: {concurrency: {median aggregate/per-stream tok/s, acceptance}}}."""
    out: dict = {}
    for r in rows:
        if "aggregate_tok_s" not in r:
            continue
        out.setdefault(key(r), {}).setdefault(r["concurrency"], []).append(r)
    res = {}
    for lab, by in out.items():
        res[lab] = {}
        for c, rs in sorted(by.items()):
            acc = [r["mtp_acceptance_length"] for r in rs if r.get("mtp_acceptance_length")]
            per = [r["per_stream_tok_s"] for r in rs if r.get("per_stream_tok_s")]
            res[lab][c] = {"aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in rs),
                           "per_stream_tok_s": statistics.median(per) if per else None,
                           "acceptance_length": statistics.median(acc) if acc else None, "n": len(rs)}
            ple = [r["ple"] for r in rs if r.get("ple")]
            if ple:  # patch 1's lookups at this level alone (the server's stats line mixes the levels)
                res[lab][c]["ple"] = {k: round(statistics.median(p[k] for p in ple), 4)
                                      for k in ple[0] if k != "ops"} | {"n": len(ple)}
    return res


def ratios(summ: dict) -> dict:
    """{series: {concurrency: per-stream and aggregate tok/s as a ratio of stock's at the same layer count}}."""
    out: dict = {}
    for series, by in summ.items():
        ref = summ.get(stock_of(series))
        if not ref or series == stock_of(series):
            continue
        for c, v in by.items():
            r = ref.get(c) or {}
            out.setdefault(series, {})[c] = {
                k: round(v[k] / r[k], 3) for k in ("aggregate_tok_s", "per_stream_tok_s") if v.get(k) and r.get(k)}
    return out


GOAL_VS_STOCK = 0.90  # issue 12: FULL + hoisted within 10% of the stock ceiling


def _line(xy: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through points at two or more distinct x."""
    n = len(xy)
    mx, my = sum(x for x, _ in xy) / n, sum(y for _, y in xy) / n
    b = sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)
    return my - b * mx, b


def _boot_means(xs, resamples: int, seed: int):
    """The means of `resamples` bootstrap resamples of `xs` (numpy, fixed seed: the same rows give
    the same interval)."""
    import numpy as np

    return xs[np.random.default_rng(seed).integers(0, len(xs), (resamples, len(xs)))].mean(axis=1)


def _verdict(logs, goal: float, resamples: int, seed: int) -> dict:
    """Log ratios -> geometric mean, 95% bootstrap interval (numpy, fixed seed: the same rows give
    the same interval) and a verdict against `goal`: met when the interval lies above it, missed
    when below, else open, with the pairs an interval that narrow would need at this spread (normal
    approximation)."""
    import math

    import numpy as np

    g = math.exp(float(np.mean(logs)))
    row = {"pairs": len(logs), "geomean": round(g, 3)}
    if len(logs) < 2:
        return row | {"verdict": "open", "why": "one pair: no interval"}
    lo, hi = (math.exp(q) for q in np.quantile(_boot_means(logs, resamples, seed), [0.025, 0.975]))
    row["ci95"] = [round(lo, 3), round(hi, 3)]
    if lo >= goal:
        row["verdict"] = "met"
    elif hi < goal:
        row["verdict"] = "missed"
    else:
        row["verdict"] = "open"
        if g > goal:  # pairs for the interval's lower end to clear the goal if the mean stayed
            row["pairs_needed"] = math.ceil((1.96 * float(np.std(logs, ddof=1)) / math.log(g / goal)) ** 2)
    return row


def paired(rows: list[dict], goal: float = GOAL_VS_STOCK, resamples: int = 20_000, seed: int = 0) -> dict:
    """Each config against stock, pair by pair: the same layer count, concurrency and repeat (the
    matrix measures the servers back to back, so a pair shares one window of the machine's noise).
    Pooled over the pairs: `_verdict` (geometric mean of the per-stream ratios, 95% bootstrap
    interval, met/missed/open against `goal`), median and range; and the same verdict per
    concurrency (`per_concurrency`): a pooled mean can sit on the goal while one level misses it."""
    import math

    import numpy as np

    tok: dict = {}
    for r in rows:
        if r.get("per_stream_tok_s"):  # `run`: which file a row came from (plot's), so no pair spans two runs
            tok[(r["label"], r.get("layers"), r["concurrency"], r.get("repeat"), r.get("run", 0))] = r["per_stream_tok_s"]
    out: dict = {}
    for label in sorted({k[0] for k in tok} - {"stock"}):
        keys = sorted((k for k in tok if k[0] == label and ("stock", *k[1:]) in tok), key=lambda k: tuple(map(str, k)))
        logs = np.log([tok[k] / tok[("stock", *k[1:])] for k in keys])
        if not len(logs):
            continue
        levels = sorted({k[2] for k in keys})
        mask = {c: np.array([k[2] == c for k in keys]) for c in levels}
        at = {c: logs[mask[c]] for c in levels}
        # ms per stream and step (acceptance 1) the config adds to stock's, pair by pair
        added = np.array([1000.0 / tok[k] - 1000.0 / tok[("stock", *k[1:])] for k in keys])
        row = {"pairs": len(logs), "geomean": round(math.exp(logs.mean()), 3),
               "median": round(math.exp(float(np.median(logs))), 3),
               "min": round(math.exp(logs.min()), 3), "max": round(math.exp(logs.max()), 3), "goal": goal,
               "by_concurrency": {c: round(math.exp(float(at[c].mean())), 3) for c in levels}}
        row |= {k: v for k, v in _verdict(logs, goal, resamples, seed).items() if k not in row}
        row["per_concurrency"] = {c: _verdict(at[c], goal, resamples, seed)
                                  | {"added_ms": _mean_ci(added[mask[c]], resamples, seed)} for c in levels}
        out[label] = row
    return out


def _mean_ci(xs, resamples: int, seed: int) -> dict:
    """Mean and 95% bootstrap interval (fixed seed), rounded to µs."""
    import numpy as np

    row = {"mean": round(float(np.mean(xs)), 3)}
    if len(xs) > 1:
        row["ci95"] = [round(float(q), 3) for q in np.quantile(_boot_means(xs, resamples, seed), [0.025, 0.975])]
    return row


def at_layers(summ: dict, pair: dict, layers: int = LAYERS) -> dict:
    """An estimate, per concurrency, of each config against stock at `layers`: stock's ms per step
    read off its line through the measured layer counts (per-stream medians), plus the ms the config
    adds per step (`paired`'s `added_ms`) taken as layer-independent: right for the hoisted gather
    (one PLE layer, one hook per step, whatever the layer count), wrong for eager (PIECEWISE leaves
    the graph at every attention layer). Ratio = stock / (stock + added), with the added ms's interval."""
    pts: dict = {}
    for series, by in summ.items():
        cfg, _, L = series.partition("/L")
        if cfg == "stock" and L.isdigit():
            for c, v in by.items():
                if v.get("per_stream_tok_s"):
                    pts.setdefault(c, []).append((int(L), 1000.0 / v["per_stream_tok_s"]))
    stock, floors = {}, {}
    for c, xy in sorted(pts.items()):
        if len({x for x, _ in xy}) < 2:
            continue
        a, b = _line(xy)
        if b > 0:
            stock[c] = a + b * layers
        else:  # a step cannot shrink with more layers: the cells' noise made this line
            floors[c] = f"stock's line at c={c} falls with the layers (slope {b:.3f} ms per layer): noise"
    if stock:
        # a level without a rising line of its own: the lowest level's line is a floor (a step at a
        # higher concurrency is not shorter), so its ratio is a lower bound
        low = min(stock)
        for c in sorted(set(pts) - {low}):
            if c in floors:
                floors[c] += f"; c={low}'s line used as a floor: the ratio is a lower bound"
            elif c in stock and stock[c] < stock[low]:
                floors[c] = (f"stock's line at c={c} reads {stock[c]:.2f} ms, under c={low}'s: noise; "
                             f"c={low}'s used as a floor: the ratio is a lower bound")
            else:
                continue
            stock[c] = stock[low]
    out: dict = {"note": f"estimate: stock's line at {layers} layers + the measured added ms per step, taken as "
                         "layer-independent (one PLE layer: true of the hoisted gather, not of eager)",
                 f"stock_ms_L{layers}": {c: round(v, 3) for c, v in sorted(stock.items())}}
    if floors:
        out["floors"] = floors
    if not stock:
        return out | {"why": "no rising stock line through two layer counts at any level"}
    for label, row in pair.items():
        if label == "eager":
            continue
        per = {}
        for c, v in (row.get("per_concurrency") or {}).items():
            if c in stock and "added_ms" in v:
                s, add = stock[c], v["added_ms"]
                per[c] = {"ratio": round(s / (s + add["mean"]), 3)} | ({"bound": "lower"} if c in floors else {})
                if "ci95" in add:
                    per[c]["range"] = [round(s / (s + add["ci95"][1]), 3), round(s / (s + add["ci95"][0]), 3)]
        out[label] = per
    return out


def step_bytes(expert_bytes: float, side_bytes: float, tokens: int = 1 + MTP) -> dict:
    """Weight bytes one decode step reads at concurrency 1 (an estimate for the GB10 line).

    Per layer: the side weights (`side_bytes` per parameter) and the routed experts of the step's
    `tokens` positions, TOPK each, counted as distinct (an upper bound; random weights route
    anywhere). Fixed: the lm_head once per forward (the verify pass and each draft pass: 1 + MTP
    reads, bf16) and the MTP layer for each draft (its experts fp8, one position each). KV cache,
    PLE rows and activations are left out: at 4k context they are megabytes against gigabytes."""
    expert = 3 * HIDDEN * MOE_INTER
    per_layer = SIDE_PARAMS * side_bytes + min(EXPERTS, TOPK * tokens) * expert * expert_bytes
    mtp_layer = SIDE_PARAMS * 2 + TOPK * expert * EXPERT_BYTES["fp8"]
    fixed = (1 + MTP) * VOCAB * HIDDEN * 2 + MTP * mtp_layer
    return {"per_layer": per_layer, "fixed": fixed}


# What the bench's checkpoint holds (--quant fp8: FP8_PB_WO experts, bf16 side layers) and what the
# recipe serves on a Spark (MODE=hybrid: NVFP4 experts, fp8 side layers)
BENCH_BYTES = step_bytes(EXPERT_BYTES["fp8"], 2.0)
RECIPE_BYTES = step_bytes(EXPERT_BYTES["nvfp4"], 1.0)


def extrapolate(summ: dict, layers: int = LAYERS, bw_h200_gbs: float | None = None, bw_gb10_gbs: float = 273.0,
                measured_bytes: dict = BENCH_BYTES, recipe_bytes: dict = RECIPE_BYTES) -> dict:
    """Per config, at concurrency 1: ms per decoded token against the layer count, a least-squares
    line through the measured counts, read at `layers` (an estimate: it assumes the per-layer cost
    is the same in every repeat of the pattern).

    With the H200's measured copy bandwidth, three GB10 figures, all estimates, per decode step
    (= per token at random weights' acceptance length 1; trained weights multiply them by theirs):
    - `gb10_tok_s_all_scaled`: the whole step time stretched by the bandwidth ratio: a floor, since
      most of an H200 step at batch 1 is not spent moving bytes;
    - `gb10_tok_s_estimate`: the step split into the weight bytes it reads (`measured_bytes`, at the
      H200's bandwidth) and the rest (launches, host work, latency), which is kept as measured;
      the bytes are then read at the GB10's bandwidth;
    - `gb10_tok_s_estimate_recipe_bytes`: the same with the recipe's own bytes (NVFP4 experts, fp8
      side layers) instead of the bench checkpoint's (fp8 experts, bf16 side layers)."""
    pts: dict = {}
    for series, by in summ.items():
        if "/L" not in series or not (by.get(1) or {}).get("per_stream_tok_s"):
            continue
        cfg, L = series.split("/L")
        pts.setdefault(cfg, []).append((int(L), 1000.0 / by[1]["per_stream_tok_s"]))
    out = {}
    for cfg, xy in pts.items():
        xy.sort()
        if len({x for x, _ in xy}) < 2:
            out[cfg] = {"points": xy, "note": "one layer count: no line to extrapolate"}
            continue
        a, b = _line(xy)
        ms = a + b * layers
        row = {"points": xy, "ms_fixed": round(a, 3), "ms_per_layer": round(b, 4), f"ms_per_token_L{layers}": round(ms, 3),
               f"tok_s_L{layers}_h200_estimate": round(1000.0 / ms, 1)}
        if bw_h200_gbs:
            def read_ms(by: dict, gbs: float) -> float:
                return (by["fixed"] + layers * by["per_layer"]) / (gbs * 1e9) * 1000.0

            other = max(ms - read_ms(measured_bytes, bw_h200_gbs), 0.0)
            row |= {"gb10_tok_s_all_scaled": round(1000.0 / (ms * bw_h200_gbs / bw_gb10_gbs), 1),
                    "h200_ms_reading_weights": round(read_ms(measured_bytes, bw_h200_gbs), 3),
                    "ms_other": round(other, 3),
                    "gb10_tok_s_estimate": round(1000.0 / (other + read_ms(measured_bytes, bw_gb10_gbs)), 1),
                    "gb10_tok_s_estimate_recipe_bytes": round(1000.0 / (other + read_ms(recipe_bytes, bw_gb10_gbs)), 1)}
        out[cfg] = row
    return out


def plot_cmd(args) -> int:
    # each row tagged with its file: the pairs stay inside one run (two runs repeat the same keys)
    rows = [json.loads(line) | {"run": i} for i, f in enumerate(args.files) for line in open(f) if line.strip()]
    summ = summarize(rows)
    pair = paired(rows)
    report = {"summary": summ, "ratios_vs_stock": ratios(summ), "paired_vs_stock": pair,
              "extrapolated": extrapolate(summ, bw_h200_gbs=args.bandwidth_gbs),
              f"vs_stock_L{LAYERS}": at_layers(summ, pair)}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted(summ, key=lambda k: (k.split("/")[1:], ALL_CONFIGS.index(k.split("/")[0]) if k.split("/")[0] in ALL_CONFIGS else 9))
    levels = sorted({c for lab in summ.values() for c in lab})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(labels))
    for ax, metric, title in ((axes[0], "aggregate_tok_s", "decode tok/s, all streams"),
                              (axes[1], "per_stream_tok_s", "decode tok/s per stream")):
        for i, lab in enumerate(labels):
            xs = [j + i * width for j in range(len(levels))]
            ys = [(summ[lab].get(c) or {}).get(metric) or 0 for c in levels]
            bars = ax.bar(xs, ys, width, label=lab)
            if stock_of(lab) in summ and lab != stock_of(lab):
                for b, c in zip(bars, levels):
                    ref = (summ[stock_of(lab)].get(c) or {}).get(metric)
                    if ref and b.get_height():
                        ax.annotate(f"{b.get_height() / ref:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(levels))])
        ax.set_xticklabels([f"c={c}" for c in levels])
        ax.set_title(title)
    fig.suptitle("decode, MTP=2, --load-format dummy (ratios vs stock)")
    # one legend under both panels: inside them it covered the tallest bars
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir")
    p.add_argument("--quant", choices=("nvfp4", "fp8"), default="nvfp4")
    p.add_argument("--ple-rows", default="full", help="'full' (320,001,536 rows, 47.68 GiB) or a row count")
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers: a multiple of 4 up to 48 (the real 48)")
    p.set_defaults(func=prepare)
    p = sub.add_parser("configs", help="print the servers `matrix --configs` accepts (gpu_session checks against it)")
    p.set_defaults(func=lambda args: print(",".join(ALL_CONFIGS)) or 0)
    p = sub.add_parser("plan")
    p.add_argument("dir")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=plan_cmd)
    for name in ("serve-run", "run"):
        p = sub.add_parser(name)
        if name == "serve-run":
            p.add_argument("dir")
            p.add_argument("config", choices=ALL_CONFIGS)
            p.add_argument("--port", type=int, default=8000)
            p.add_argument("--boot-timeout", type=float, default=1200)
            p.add_argument("--log")
            p.set_defaults(func=serve_run)
        else:
            p.add_argument("url")
            p.add_argument("--label", required=True)
            p.set_defaults(func=run_cmd)
        p.add_argument("--out", required=True, help="JSONL file, appended")
        p.add_argument("--levels", default="1,4,8")
        p.add_argument("--tokens", type=int, default=256)
        p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("matrix", help="boot the configs side by side, measure them in turn (rotated), stop")
    p.add_argument("dir")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", required=True, help="JSONL file, appended")
    p.add_argument("--logs", help="server logs go here (default: beside --out)")
    p.add_argument("--levels", default="1,4,8")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--boot-timeout", type=float, default=600)
    p.add_argument("--warmup-tokens", type=int, default=64, help="an untimed round per config and level first (0: none)")
    p.add_argument("--ple-settle", type=float, default=PLE_SETTLE_S,
                   help="s to wait after each eager/hoisted round before reading its PLE counters (0: read at once)")
    p.add_argument("--deadline", type=float, default=3600, help="s from start: stop measuring (rows so far are kept)")
    p.set_defaults(func=matrix)
    p = sub.add_parser("greedy", help="fixed token-id prompts, greedy, token ids to a JSON file")
    p.add_argument("url")
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--eos", type=int, default=248044, help="the config's eos_token_id (PLE context resets there)")
    p.add_argument("--vocab", type=int, default=248320)
    p.set_defaults(func=greedy_cmd)
    p = sub.add_parser("greedy-diff", help="exit 1 at the first token that differs")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(func=greedy_diff)
    p = sub.add_parser("plot")
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--json", help="also write the summary, ratios and extrapolation here")
    p.add_argument("--bandwidth-gbs", type=float, help="the H200's measured copy bandwidth (GB10 estimate)")
    p.set_defaults(func=plot_cmd)
    args = ap.parse_args(argv)
    if getattr(args, "ple_settle", 0) < 0:
        raise SystemExit(f"--ple-settle {args.ple_settle}: give 0 (read at once) or seconds such as {PLE_SETTLE_S}")
    if getattr(args, "warmup_tokens", 0) < 0:
        raise SystemExit(f"--warmup-tokens {args.warmup_tokens}: give 0 (no warm-up) or a token count such as 64")
    if getattr(args, "ple_rows", "full") != "full" and not str(args.ple_rows).isdigit():
        raise SystemExit(f"--ple-rows {args.ple_rows!r}: give 'full' or a row count such as 32000000")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
