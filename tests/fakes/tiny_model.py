"""A tiny `qwen4_exp` that vLLM can actually boot, in the real layouts, written by our own code.

`ckpt.py` knows the layouts (names, dtypes, files); this module picks dimensions and a config vLLM
0.33 accepts and fills every tensor with values that make a valid (random) model:
- NVFP4 experts: random packed e2m1 codes (every nibble is a valid FP4 value) with positive e4m3
  block scales, one `weight_scale_2` per layer and one `input_scale`, so dequantized weights are ~0.02;
- the PLE table: random finite e4m3 codes, a small positive BF16 `weight_scale`, and the I64 buffers
  `layer_multipliers` / `ngram_heads_offsets` / `ngram_heads_vocab_sizes` holding EXACTLY what vLLM's
  `Qwen4ExpNGramEmbedding._make_layer_multipliers/_make_vocab_layout` compute for this config
  (computed by our `flash_vllm.ple.hashing`; the vllm tier compares them with the release's own code);
- norms near 1, other BF16 weights N(0, 0.02), fp8 MTP experts with positive block scales;
- (d) the QAD export's layout (ckpt.py `qad`): MXFP8 side layers (finite E4M3 codes, UE8M0 scale
  2^-14: |w| <= 0.03) and the NVFP4 PLE table (codes, positive E4M3 block scales, `weight_scale_2`
  as the experts': rows up to 0.12), which patch 1 serves through its NVFP4 codec.

Tiny-config traps measured on the H200 (issue 11): `indexer_budget / indexer_compress_ratio` must be
512, 1024 or 2048 (vLLM's cooperative top-k), so the real 2048/4 is kept; the QSA ring capacity (32)
must divide the attention block size, so boots pass `--block-size 256`; head dims stay real (256 /
128) because the kernels are built for them; `hc_count` stays 4.

The tokenizer is a byte-level BPE (tests/fakes/data/tiny-tokenizer.json, made by
make_tiny_tokenizer.py) with Qwen's 33 added tokens, so chat prompts, `<think>` and `<tool_call>`
tokenize offline; `vocab_size` (2048) covers it.

    build(cache) -> {"a": <nvidia snapshot>, "b": <a>-fp8hybrid, "c": <radixark>-fp8hybrid-mtpnvfp4,
                     "d": <qad snapshot>}
    python tests/fakes/tiny_model.py CACHE_DIR [--json]
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: make `fakes` importable
    sys.path.insert(0, str(HERE.parent))

from fakes import ckpt  # noqa: E402

TOKENIZER = HERE / "data" / "tiny-tokenizer.json"
VOCAB = 2048
LAYERS = 4          # GDN 0, 1 (PLE), 2; QSA 3: every kind once
EXPERTS = 8
TOP_K = 2
PLE_BASE = 40009    # 16 primes from 40,009: 640,384 rows x 16 B = 10 MB of fp8 (visible on the GPU with patch 1 off)
PLE_PARTS = 8
MAX_MB = 40
DONOR_REVISION = "e2e0" * 10

TEXT = {
    "hidden_size": 256,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128,
    "indexer_budget": 2048, "indexer_compress_ratio": 4,
    "hc_count": 4, "hc_lowrank": 64,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
}


def added_tokens() -> dict[str, int]:
    return {t["content"]: t["id"] for t in json.loads(TOKENIZER.read_text())["added_tokens"]}


def dims() -> ckpt.Dims:
    t = TEXT
    gdn_qkv = 2 * t["linear_num_key_heads"] * t["linear_key_head_dim"] + t["linear_num_value_heads"] * t["linear_value_head_dim"]
    lay = ple_layout()
    return ckpt.Dims(
        hidden=t["hidden_size"], layers=LAYERS, experts=EXPERTS, experts_per_file=4,
        moe_inter=t["moe_intermediate_size"], shared_inter=t["shared_expert_intermediate_size"],
        gdn_qkv=gdn_qkv, gdn_z=t["linear_num_value_heads"] * t["linear_value_head_dim"],
        gdn_heads=t["linear_num_value_heads"], q_out=2 * t["num_attention_heads"] * t["head_dim"],
        kv_out=t["num_key_value_heads"] * t["head_dim"],
        idx_out=(t["indexer_n_heads"] + t["indexer_kv_heads"]) * t["indexer_head_dim"], vocab=VOCAB,
        hc=t["hc_count"], hc_low=t["hc_lowrank"], ple_shards=lay.num_shards, ple_rows=lay.rows_per_shard,
        ple_width=lay.head_dim, ple_files=3, vis_hidden=64, vis_inter=128,
        head_dim=t["head_dim"], idx_head_dim=t["indexer_head_dim"], gdn_v_dim=t["linear_value_head_dim"],
        vis_blocks=2)


def text_config() -> dict:
    tok = added_tokens()
    eos = tok["<|endoftext|>"]
    return {
        "model_type": "qwen4_exp_text", "vocab_size": VOCAB, "num_hidden_layers": LAYERS,
        "layer_types": ["full_attention" if ckpt.is_qsa(i) else "linear_attention" for i in range(LAYERS)],
        "full_attention_interval": 4, "max_position_embeddings": 262144,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "output_gate_type": "sigmoid", "mamba_ssm_dtype": "float32",
        **TEXT,
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001, "output_router_logits": False,
        "ple_layer_ids": [2], "ple_embed_dim": TEXT["hidden_size"], "ple_conv_kernel_size": 4, "ngram_size": 3,
        "heads_per_ngram": 8, "ngram_vocab_size_base": PLE_BASE, "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": PLE_PARTS,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "mtp": {"hybrid": True, "layer_types": ["full_attention"], "num_hidden_layers": 1, "rope_theta": 10000000,
                "mtp_use_hidden_state_from_layer": None},
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": None,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "initializer_range": 0.02,
        "dtype": "bfloat16", "use_cache": True, "tie_word_embeddings": False,
    }


def ple_layout():
    from flash_vllm.ple.hashing import PLELayout

    tok = added_tokens()
    cfg = {"vocab_size": VOCAB, "eos_token_id": tok["<|endoftext|>"], "ngram_size": 3, "heads_per_ngram": 8,
           "ngram_vocab_size_base": PLE_BASE, "make_ngram_vocab_size_divisible_by": 128,
           "split_ngram_parts": PLE_PARTS, "ple_embed_dim": TEXT["hidden_size"]}
    return PLELayout.from_config(cfg, 0)


def ple_buffers() -> dict[str, list[int]]:
    lay = ple_layout()
    return {"layer_multipliers": list(lay.multipliers), "ngram_heads_offsets": list(lay.head_offsets),
            "ngram_heads_vocab_sizes": list(lay.head_sizes)}


CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.content is string %}{%- set text = m.content %}
{%- elif m.content is none or m.content is undefined %}{%- set text = '' %}
{%- else %}{%- set text = namespace(v='') %}{%- for c in m.content %}{%- if c.type == 'text' %}{%- set text.v = text.v ~ c.text %}{%- endif %}{%- endfor %}{%- set text = text.v %}
{%- endif %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ text }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ text }}
{%- if m.tool_calls %}
{%- for tc in m.tool_calls %}
<tool_call>
<function={{ tc.function.name }}>
{%- set args = tc.function.arguments %}
{%- if args is string %}
{{ args }}
{%- else %}
{%- for k, v in args.items() %}
<parameter={{ k }}>
{{ v }}
</parameter>
{%- endfor %}
{%- endif %}
</function>
</tool_call>
{%- endfor %}
{%- endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}
{%- endif %}"""


def small_files(flavour: str, d: ckpt.Dims) -> dict[str, str]:
    """ckpt.configs() (the layouts' quant configs) with a config vLLM can build and a usable tokenizer."""
    out = ckpt.configs(flavour, d)
    tok = added_tokens()
    cfg = json.loads(out["config.json"])
    cfg["text_config"] = {**cfg["text_config"], **text_config()}  # keeps RadixArk's ple_embedding_dtype
    cfg["vision_config"] = {"model_type": "qwen4_exp", "depth": d.vis_blocks, "hidden_size": d.vis_hidden,
                            "intermediate_size": d.vis_inter, "num_heads": 2, "in_channels": 3,
                            "hidden_act": "gelu_pytorch_tanh", "out_hidden_size": d.hidden, "patch_size": 16,
                            "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
                            "deepstack_visual_indexes": [], "initializer_range": 0.02}
    cfg.update({"image_token_id": tok["<|image_pad|>"], "video_token_id": tok["<|video_pad|>"],
                "vision_start_token_id": tok["<|vision_start|>"], "vision_end_token_id": tok["<|vision_end|>"],
                "tie_word_embeddings": False, "language_model_only": False, "transformers_version": "5.8.0.dev0"})
    out["config.json"] = json.dumps(cfg, indent=2)
    eos, im_end = tok["<|endoftext|>"], tok["<|im_end|>"]
    out["generation_config.json"] = json.dumps({"bos_token_id": eos, "eos_token_id": [im_end, eos],
                                                "pad_token_id": eos, "temperature": 1.0, "top_k": 20, "top_p": 0.95})
    out["tokenizer.json"] = TOKENIZER.read_text()
    out["tokenizer_config.json"] = json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 262144, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in tok.items()}})
    out["chat_template.jinja"] = CHAT_TEMPLATE
    # the classes transformers maps qwen4_exp to; small pixel bounds keep one image or video within the
    # 2,048-token context (64x64..256x256 px: 4..64 tokens after the 2x2 merge)
    px = {"shortest_edge": 4096, "longest_edge": 65536}
    common = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
              "image_std": [0.5, 0.5, 0.5], "size": px}
    out["preprocessor_config.json"] = json.dumps({"image_processor_type": "Qwen2VLImageProcessor", **common})
    out["video_preprocessor_config.json"] = json.dumps({"video_processor_type": "Qwen3VLVideoProcessor", **common,
                                                        "fps": 2, "min_frames": 2, "max_frames": 8})
    return out


def _as(a, kind: str):
    """float32 / uint8-code numpy array → a BF16 or F8_E4M3 array safetensors can write: ml_dtypes where
    installed (the project venv), else torch (the GPU device's vLLM env has torch, not ml_dtypes)."""
    import numpy as np

    try:
        import ml_dtypes
    except ImportError:
        import torch

        t = torch.from_numpy(np.array(a, order="C"))  # keeps 0-d scalars 0-d
        if kind == "bf16":
            return t.to(torch.bfloat16)
        return t.view(torch.float8_e4m3fn) if a.dtype == np.uint8 else t.to(torch.float8_e4m3fn)
    if kind == "bf16":
        return a.astype(ml_dtypes.bfloat16)
    return a.view(ml_dtypes.float8_e4m3fn) if a.dtype == np.uint8 else a.astype(ml_dtypes.float8_e4m3fn)


def values(name: str, dtype: str, shape: tuple, rng):
    """A valid value for every tensor of the layouts (see the module doc)."""
    import numpy as np

    n = ckpt._numel(shape)
    leaf = name.rsplit(".", 1)[-1]
    if dtype == "I64":
        return np.asarray(ple_buffers()[leaf], dtype=np.int64).reshape(shape)
    if dtype == "U8":
        if leaf == "weight_scale":  # MXFP8 (qad): one UE8M0 exponent byte per 32 values, 2^(113-127)
            return np.full(shape, 113, dtype=np.uint8)
        return rng.integers(0, 256, n, dtype=np.uint8).reshape(shape)  # e2m1 pairs: all 16 codes finite
    if dtype == "F8_E4M3":
        if leaf == "weight_scale":  # NVFP4 block scales: positive e4m3 in [64, 448]
            return _as(rng.uniform(64, 448, n).astype(np.float32).reshape(shape), "fp8")
        codes = rng.integers(0, 0x7F, n, dtype=np.uint8) | (rng.integers(0, 2, n, dtype=np.uint8) << 7)
        return _as(codes.reshape(shape), "fp8")  # finite e4m3 (0x7F/0xFF are NaN)
    if dtype == "F32":
        if leaf == "weight_scale_2":  # per-tensor FP4 scale: |w| ≤ 6 · 448 · s = 0.12
            return np.full(shape, 0.02 / 448, dtype=np.float32)
        if leaf == "input_scale":  # activations up to ~27 in FP4 · e4m3 range
            return np.full(shape, 0.01, dtype=np.float32)
        if leaf == "A_log":
            return np.log(rng.uniform(1, 16, n)).astype(np.float32).reshape(shape)
        return rng.uniform(0.9, 1.1, n).astype(np.float32).reshape(shape)  # GDN norm weight
    if dtype == "BF16":
        if leaf == "weight_scale":  # the PLE table's per-tensor scale: rows up to ±448 · 1e-4
            a = np.full(n, 1e-4, dtype=np.float32)
        elif leaf == "weight_scale_inv":  # fp8 MTP expert block scales
            a = rng.uniform(1e-4, 2e-4, n).astype(np.float32)
        elif "norm" in name and len(shape) == 1:
            a = (1 + rng.standard_normal(n) * 0.02).astype(np.float32)
        elif name.endswith("dt_bias") or name.endswith(".bias"):
            a = (rng.standard_normal(n) * 0.02).astype(np.float32)
        else:
            a = (rng.standard_normal(n) * 0.02).astype(np.float32)
        return _as(a.reshape(shape), "bf16")
    raise ValueError(f"{name}: no value rule for dtype {dtype}")


def write(cache: Path, flavour: str) -> Path:
    return ckpt.write_snapshot(Path(cache), flavour, dims(), values=values, small_files=small_files,
                               revision=DONOR_REVISION if flavour == "donor" else None)


def served_bytes(directory: Path) -> int:
    """Bytes vLLM reads from a checkpoint directory (symlinks followed)."""
    return sum(f.stat().st_size for f in Path(directory).iterdir() if f.is_file())


def build(cache: Path, python: str = sys.executable) -> dict[str, Path]:
    """(a) nvidia NVFP4, (b) (a) through `flash prepare hybrid`, (c) RadixArk through `flash prepare graft`,
    (d) the QAD export as published (MXFP8 side layers, NVFP4 PLE table; nothing to prepare).

    (b) runs the real CLI. (c) runs the graft's own function (`flash prepare graft` pins the real
    Inferact donor by revision and sha256; here the pin is the tiny donor's): same code, other pin.
    """
    from flash_cli import hfcache
    from flash_cli.checkpoint import graft, hybrid
    from flash_cli.settings import resolve

    cache = Path(cache)
    a = write(cache, "nvidia")
    env = {"HF_CACHE": str(cache), "MODEL": ckpt.NVIDIA, "MODE": "hybrid"}
    cmd = [python, "-m", "flash_cli", "prepare", "hybrid", "--no-profile", "--json",
           *(f"{k}={v}" for k, v in env.items())]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    b = hfcache.variant_dir(a, "hybrid")
    r = write(cache, "radixark")
    hybrid.prepare(r)
    donor_snap = write(cache, "donor")
    path = donor_snap / "nvfp4_experts_mtp.safetensors"
    donor = graft.Donor(revision=DONOR_REVISION, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    settings = resolve(overrides={"MODEL": ckpt.RADIXARK, "HF_CACHE": str(cache), "MODE": "hybrid-mtp"})
    graft.prepare(r, settings, donor=donor)
    c = hfcache.variant_dir(r, "hybrid-mtp")
    return {"a": a, "b": b, "c": c, "d": write(cache, "qad")}


# settings that point the recipe at each fixture (MODEL, MODE; REVISION pins the snapshot)
def recipe_for(which: str, snaps: dict[str, Path]) -> dict[str, str]:
    model, mode = {"a": (ckpt.NVIDIA, "nvfp4"), "b": (ckpt.NVIDIA, "hybrid"), "c": (ckpt.RADIXARK, "hybrid-mtp"),
                   "d": (ckpt.QAD, "nvfp4")}[which]
    base_snap = {"a": snaps["a"], "b": snaps["a"], "d": snaps["d"]}.get(which) or Path(str(snaps["c"]).split("-fp8hybrid")[0])
    return {"MODEL": model, "MODE": mode, "REVISION": base_snap.name}


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: python tests/fakes/tiny_model.py CACHE_DIR [--json]", file=sys.stderr)
        return 2
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # the writers' progress lines; stdout is the answer
        snaps = build(Path(argv[0]))
    sizes = {k: served_bytes(v) for k, v in snaps.items()}
    out = {k: {"path": str(v), "bytes": sizes[k]} for k, v in snaps.items()}
    print(json.dumps(out, indent=2) if "--json" in argv else "\n".join(f"{k}: {v['path']} ({v['bytes'] / 1e6:.1f} MB)"
                                                                       for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
