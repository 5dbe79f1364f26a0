"""The model the decode bench serves: the real Qwen3.8-Flash-Next text shape (48 layers, 3 GDN + 1
QSA, 512 experts, MTP=2) as a config.json, quantization configs, a word-level tokenizer covering every
id, and a PLE table written by flash's own writer; `prepare` writes them to a directory that
`vllm serve --load-format dummy` boots. Fewer layers keep every per-layer shape (said in meta.json)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path


P = "model.language_model."

LAYERS, EXPERTS, HIDDEN, MOE_INTER, VOCAB = 48, 512, 2560, 640, 248_320

TOPK, MTP = 10, 2  # experts per token (num_experts_per_tok); draft tokens the servers run with

SIDE_PARAMS = 60e6  # attention or GDN + shared expert + router per layer (memory_estimate's figure)

EXPERT_BYTES = {"nvfp4": 0.5 + 1 / 16, "fp8": 1.0 + 4 / (128 * 128)}  # per parameter, block scales included

FULL_NGRAM_BASE = 20_000_000

GPU_GIB = 139  # the H200's memory as the device machine reports it


def is_qsa(i: int) -> bool:
    return i % 4 == 3


def check_layers(layers: int) -> int:
    """The real model's 3:1 GDN/QSA pattern repeats every 4 layers; the PLE layer (id 2) needs >= 3."""
    if layers < 4 or layers > LAYERS or layers % 4:
        raise SystemExit(f"--layers {layers}: give a multiple of 4 from 4 to {LAYERS} (the 3 GDN + 1 QSA pattern)")
    return layers


def text_config(ngram_base: int, layers: int = LAYERS) -> dict:
    """Every field of the published config.json's text_config, none left to transformers' defaults;
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
         "<tts_text_bos_single>", "<|audio_pad|>")  # 248044.. (the published tokenizer's added tokens)

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
    configs_only = args.configs_only  # the configs alone: what `flash plan --config` reads
    if table_bytes + (1 << 30) > free and not configs_only:
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
    if not configs_only and not (ple / "model.safetensors.index.json").exists():
        synth.write_checkpoint(ple, layout="nvidia", rows_per_shard=rps, num_shards=layout.num_shards,
                               last_rows=last, width=layout.head_dim, scale=0.03125, finite=True)
    meta = {"quant": args.quant, "layers": layers, "ple_rows": layout.num_rows, "ngram_vocab_size_base": base,
            "full_table": args.ple_rows == "full", "ple_write_s": round(time.monotonic() - t0, 1),
            "table_written": not configs_only,
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
