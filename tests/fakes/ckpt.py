"""Layout-faithful synthetic checkpoints of Qwen3.8-Flash-Next in a real HF cache layout.

Two flavours of the same generator (names, dtypes, shape formulas and file layouts as the
published checkpoints' config.json, safetensors indexes and headers give them):
- `TINY` dims with real random data (numerical checks; written with the `safetensors` library),
- `REAL` dims as sparse files (real names, shapes, dtypes, header bytes and file sizes; data
  are holes, so 135 GB cost no disk) for the scale tier.
Layouts: `radixark` (`model-bf16-000{01,10,11,12}`, `model-plefp8-0000N`,
`layer-LLLLL-experts-FFFF-LLLL`, audit `.complete.json` files) and `nvidia`
(`model-000NN-of-00010` + `model-fp8-mtp-ple`, MIXED_PRECISION), and `qad`: the ModelOpt
quantization-aware-distilled export NVIDIA's recipe serves (local-inference-lab/…-NVFP4,
nvidia/…-FP4-Local; docs/CHECKPOINTS.md): `model-000NN-of-000NN` shards, MXFP8 side layers
(F8_E4M3 + U8 UE8M0 scale per 32), NVFP4 routed and MTP experts, an NVFP4 PLE table (U8 codes
[rows, w/2] + F8_E4M3 scales [rows, w/16] per shard, one F32 `weight_scale_2`) and its
`export-manifest.json`; which tensor sits in which of its shards is not public, so the fixture
spreads them in index order. The split of non-expert
tensors over RadixArk's four bf16 files is an approximation (the counts 386/48/818/182 are
close to the real 385/58/821/170; the exact assignment is not public). `donor()` writes the
Inferact MTP donor file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from flash_cli.checkpoint import stwriter

DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I64": 8, "F16": 2}


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    experts: int
    experts_per_file: int
    moe_inter: int
    shared_inter: int
    gdn_qkv: int
    gdn_z: int
    gdn_heads: int
    q_out: int
    kv_out: int
    idx_out: int
    vocab: int
    hc: int
    hc_low: int
    ple_shards: int
    ple_rows: int
    ple_width: int
    ple_files: int
    vis_hidden: int
    vis_inter: int
    # head geometry (defaults = the real model's; the valid tiny model of tiny_model.py keeps them)
    head_dim: int = 256
    idx_head_dim: int = 128
    gdn_v_dim: int = 128
    vis_blocks: int = 27

    @property
    def hcw(self) -> int:
        return self.hc * self.hidden


REAL = Dims(hidden=2560, layers=48, experts=512, experts_per_file=128, moe_inter=640, shared_inter=640,
            gdn_qkv=10240, gdn_z=6144, gdn_heads=48, q_out=12288, kv_out=512, idx_out=640, vocab=248320,
            hc=4, hc_low=320, ple_shards=128, ple_rows=2500012, ple_width=160, ple_files=10,
            vis_hidden=1152, vis_inter=4304)
TINY = Dims(hidden=256, layers=8, experts=4, experts_per_file=2, moe_inter=128, shared_inter=128,
            gdn_qkv=512, gdn_z=256, gdn_heads=8, q_out=512, kv_out=128, idx_out=128, vocab=1024,
            hc=2, hc_low=32, ple_shards=8, ple_rows=64, ple_width=16, ple_files=3,
            vis_hidden=64, vis_inter=128)

RADIXARK = "RadixArk/Qwen3.8-Flash-Next-NVFP4"
NVIDIA = "nvidia/Qwen3.8-Flash-Next-NVFP4"
DONOR = "Inferact/Qwen3.8-Flash-Next-NVFP4"
QAD = "local-inference-lab/Qwen3.8-Flash-Next-NVFP4"
FP4_LOCAL = "nvidia/Qwen3.8-Flash-Next-FP4-Local"
QAD_SHARDS = 6  # the real export has 36 (model-00001-of-00036 …); the tiny one keeps the naming
# the projections the QAD export stores as MXFP8 (step-4000 / main revisions: jitLLM's replica of
# the layout, and the skinny-GEMM record: in_proj_qkv/a/b and the shared experts are MXFP8)
QAD_MXFP8 = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
             "linear_attn.out_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "self_attn.indexer.index_qk_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
             "mlp.shared_expert.down_proj")
IGNORE_13 = ["model.embed_tokens", "mtp.*", "model.mtp.*", "*.self_attn.*", "*.linear_attn.*", "*.mlp.gate*",
             "*.mlp.shared_expert.*", "*.mlp.shared_expert_gate*", "*hyper_connection*", "*.ple.*", "model.visual.*",
             "model.language_model.embed_tokens", "lm_head"]
P = "model.language_model."


def is_qsa(layer: int) -> bool:
    return layer % 4 == 3


def layer_tensors(d: Dims, L: int) -> list[tuple[str, str, tuple]]:
    """Non-expert tensors of decoder layer L (HC, attention, MoE non-expert)."""
    p = f"{P}layers.{L}."
    H, out = d.hidden, []
    for h in ("attn", "mlp"):
        out += [(f"{p}{h}_hyper_connection.hc_norm.weight", "BF16", (d.hcw,)),
                (f"{p}{h}_hyper_connection.input_mix_weight_down.weight", "BF16", (d.hc_low, d.hcw)),
                (f"{p}{h}_hyper_connection.input_mix_weight_up.weight", "BF16", (d.hcw, d.hc_low)),
                (f"{p}{h}_hyper_connection.block_inject_weight.weight", "BF16", (d.hc, d.hcw))]
    if is_qsa(L):
        a = p + "self_attn."
        out += [(a + "q_proj.weight", "BF16", (d.q_out, H)), (a + "k_proj.weight", "BF16", (d.kv_out, H)),
                (a + "v_proj.weight", "BF16", (d.kv_out, H)), (a + "o_proj.weight", "BF16", (H, d.q_out // 2)),
                (a + "q_norm.weight", "BF16", (d.head_dim,)), (a + "k_norm.weight", "BF16", (d.head_dim,)),
                (a + "indexer.index_qk_proj.weight", "BF16", (d.idx_out, H)),
                (a + "indexer.q_layernorm.weight", "BF16", (d.idx_head_dim,)),
                (a + "indexer.k_layernorm.weight", "BF16", (d.idx_head_dim,))]
    else:
        a = p + "linear_attn."
        out += [(a + "in_proj_qkv.weight", "BF16", (d.gdn_qkv, H)), (a + "in_proj_z.weight", "BF16", (d.gdn_z, H)),
                (a + "in_proj_a.weight", "BF16", (d.gdn_heads, H)), (a + "in_proj_b.weight", "BF16", (d.gdn_heads, H)),
                (a + "out_proj.weight", "BF16", (H, d.gdn_z)), (a + "conv1d.weight", "BF16", (d.gdn_qkv, 1, 4)),
                (a + "A_log", "F32", (d.gdn_heads,)), (a + "dt_bias", "BF16", (d.gdn_heads,)),
                (a + "norm.weight", "F32", (d.gdn_v_dim,))]
    m = p + "mlp."
    out += [(m + "gate.weight", "BF16", (d.experts, H)), (m + "shared_expert_gate.weight", "BF16", (1, H)),
            (m + "shared_expert.gate_proj.weight", "BF16", (d.shared_inter, H)),
            (m + "shared_expert.up_proj.weight", "BF16", (d.shared_inter, H)),
            (m + "shared_expert.down_proj.weight", "BF16", (H, d.shared_inter))]
    return out


def nvfp4_expert(prefix: str, d: Dims, e: int) -> list[tuple[str, str, tuple]]:
    out = []
    for proj, (o, i) in (("gate_proj", (d.moe_inter, d.hidden)), ("up_proj", (d.moe_inter, d.hidden)),
                         ("down_proj", (d.hidden, d.moe_inter))):
        b = f"{prefix}.experts.{e}.{proj}."
        out += [(b + "weight", "U8", (o, i // 2)), (b + "weight_scale", "F8_E4M3", (o, i // 16)),
                (b + "weight_scale_2", "F32", ()), (b + "input_scale", "F32", ())]
    return out


def fp8_mtp_expert(d: Dims, e: int) -> list[tuple[str, str, tuple]]:
    out = []
    for proj, (o, i) in (("gate_proj", (d.moe_inter, d.hidden)), ("up_proj", (d.moe_inter, d.hidden)),
                         ("down_proj", (d.hidden, d.moe_inter))):
        b = f"mtp.layers.0.mlp.experts.{e}.{proj}."
        out += [(b + "weight", "F8_E4M3", (o, i)), (b + "weight_scale_inv", "BF16", (-(-o // 128), -(-i // 128)))]
    return out


def mtp_nonexpert(d: Dims) -> list[tuple[str, str, tuple]]:
    H = d.hidden
    out = [("mtp.fc_embedding.weight", "BF16", (H, H)), ("mtp.fc_hidden.weight", "BF16", (H, H)),
           ("mtp.pre_fc_norm_embedding.weight", "BF16", (H,)), ("mtp.pre_fc_norm_hidden.weight", "BF16", (d.hcw,)),
           ("mtp.hyper_connection_mixer.hc_norm.weight", "BF16", (d.hcw,)),
           ("mtp.hyper_connection_mixer.input_mix_weight_down.weight", "BF16", (d.hc_low, d.hcw)),
           ("mtp.hyper_connection_mixer.input_mix_weight_up.weight", "BF16", (d.hcw, d.hc_low))]
    for name, dt, shape in layer_tensors(d, 3):  # a QSA layer's HC + attention + MoE non-expert
        out.append((name.replace(f"{P}layers.3.", "mtp.layers.0."), dt, shape))
    return out


def ple_table(d: Dims) -> list[tuple[str, str, tuple]]:
    b = f"{P}layers.1.ple.ple_embedding.ngram_embedding."
    return [(f"{b}shard_{i}.weight", "F8_E4M3", (d.ple_rows, d.ple_width)) for i in range(d.ple_shards)]


def ple_rest(d: Dims) -> list[tuple[str, str, tuple]]:
    b = f"{P}layers.1.ple."
    return [(b + "ple_embedding.layer_multipliers", "I64", (3,)), (b + "ple_embedding.ngram_heads_offsets", "I64", (16,)),
            (b + "ple_embedding.ngram_heads_vocab_sizes", "I64", (16,)), (b + "key_proj.weight", "BF16", (d.hcw, d.hidden)),
            (b + "value_proj.weight", "BF16", (d.hidden, d.hidden)), (b + "norm_key.weight", "BF16", (d.hcw,)),
            (b + "norm_query.weight", "BF16", (d.hcw,)), (b + "norm_conv.weight", "BF16", (d.hcw,)),
            (b + "conv1d.weight", "BF16", (d.hcw, 1, 4))]


def vision(d: Dims) -> list[tuple[str, str, tuple]]:
    h, i, out = d.vis_hidden, d.vis_inter, []
    for blk in range(d.vis_blocks):
        b = f"model.visual.blocks.{blk}."
        out += [(b + "norm1.weight", "BF16", (h,)), (b + "norm1.bias", "BF16", (h,)), (b + "norm2.weight", "BF16", (h,)),
                (b + "norm2.bias", "BF16", (h,)), (b + "attn.qkv.weight", "BF16", (3 * h, h)), (b + "attn.qkv.bias", "BF16", (3 * h,)),
                (b + "attn.proj.weight", "BF16", (h, h)), (b + "attn.proj.bias", "BF16", (h,)),
                (b + "mlp.linear_fc1.weight", "BF16", (i, h)), (b + "mlp.linear_fc1.bias", "BF16", (i,)),
                (b + "mlp.linear_fc2.weight", "BF16", (h, i)), (b + "mlp.linear_fc2.bias", "BF16", (h,))]
    out += [("model.visual.patch_embed.proj.weight", "BF16", (h, 3, 2, 16, 16)), ("model.visual.patch_embed.proj.bias", "BF16", (h,)),
            ("model.visual.pos_embed.weight", "BF16", (2304, h)), ("model.visual.merger.norm.weight", "BF16", (h,)),
            ("model.visual.merger.norm.bias", "BF16", (h,)), ("model.visual.merger.linear_fc1.weight", "BF16", (4 * h, 4 * h)),
            ("model.visual.merger.linear_fc1.bias", "BF16", (4 * h,)), ("model.visual.merger.linear_fc2.weight", "BF16", (d.hidden, 4 * h)),
            ("model.visual.merger.linear_fc2.bias", "BF16", (d.hidden,))]
    return out


def endpoints(d: Dims):
    return ([(f"{P}embed_tokens.weight", "BF16", (d.vocab, d.hidden)), ("lm_head.weight", "BF16", (d.vocab, d.hidden))],
            [(f"{P}hyper_connection_mixer.hc_norm.weight", "BF16", (d.hcw,)),
             (f"{P}hyper_connection_mixer.input_mix_weight_down.weight", "BF16", (d.hc_low, d.hcw)),
             (f"{P}hyper_connection_mixer.input_mix_weight_up.weight", "BF16", (d.hcw, d.hc_low))])


def radixark_files(d: Dims) -> dict[str, list]:
    L = d.layers
    a = max(1, L * 2 // 48)
    b = max(a + 1, L * 4 // 48)
    c = max(b + 1, L * 40 // 48)
    lay = lambda r: [t for x in r for t in layer_tensors(d, x)]  # noqa: E731
    mtp = mtp_nonexpert(d)
    by = {n: (n, dt, s) for n, dt, s in mtp}
    to10 = ["mtp.pre_fc_norm_embedding.weight"]
    to12 = ["mtp.fc_embedding.weight", "mtp.fc_hidden.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.hyper_connection_mixer.hc_norm.weight"]
    rest = [t for t in mtp if t[0] not in to10 + to12]
    fused = [("mtp.layers.0.mlp.experts.gate_up_proj", "BF16", (d.experts, 2 * d.moe_inter, d.hidden)),
             ("mtp.layers.0.mlp.experts.down_proj", "BF16", (d.experts, d.hidden, d.moe_inter))]
    emb, mixer = endpoints(d)
    files = {
        "model-bf16-00001.safetensors": vision(d) + lay(range(0, a)) + ple_rest(d),
        "model-bf16-00010.safetensors": lay(range(a, b)) + mixer + [by[n] for n in to10],
        "model-bf16-00011.safetensors": lay(range(b, c)) + rest + fused,
        "model-bf16-00012.safetensors": lay(range(c, L)) + emb + [by[n] for n in to12],
    }
    table = ple_table(d)
    per = -(-d.ple_shards // d.ple_files)
    for f in range(d.ple_files):
        chunk = table[f * per:(f + 1) * per]
        if f == d.ple_files - 1:
            chunk = chunk + [(f"{P}layers.1.ple.ple_embedding.ngram_embedding.weight_scale", "BF16", (1,))]
        files[f"model-plefp8-{f:05d}.safetensors"] = chunk
    for layer in range(L):
        for first in range(0, d.experts, d.experts_per_file):
            last = min(d.experts, first + d.experts_per_file) - 1
            ts = [t for e in range(first, last + 1) for t in nvfp4_expert(f"{P}layers.{layer}.mlp", d, e)]
            files[f"layer-{layer:05d}-experts-{first:04d}-{last:04d}.safetensors"] = ts
    return files


def nvidia_files(d: Dims) -> dict[str, list]:
    emb, mixer = endpoints(d)
    seq = [emb[0]]
    for layer in range(d.layers):
        seq += layer_tensors(d, layer) + [t for e in range(d.experts) for t in nvfp4_expert(f"{P}layers.{layer}.mlp", d, e)]
        if layer == 1:
            seq += ple_rest(d)
    seq += [emb[1]] + mixer + mtp_nonexpert(d) + vision(d)
    nbytes = lambda t: DTYPE_BYTES[t[1]] * _numel(t[2])  # noqa: E731
    total = sum(nbytes(t) for t in seq)
    caps = [3.1, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 5.68, 0.13]
    caps = [c / sum(caps[:-1]) * total for c in caps[:-1]] + [float("inf")]
    files: dict[str, list] = {}
    i, acc = 0, 0
    for t in seq:
        if acc + nbytes(t) > caps[i] and acc > 0 and i < 9:
            i, acc = i + 1, 0
        files.setdefault(f"model-{i + 1:05d}-of-00010.safetensors", []).append(t)
        acc += nbytes(t)
    files["model-fp8-mtp-ple.safetensors"] = (
        ple_table(d) + [(f"{P}layers.1.ple.ple_embedding.ngram_embedding.weight_scale", "BF16", (1,))]
        + [t for e in range(d.experts) for t in fp8_mtp_expert(d, e)])
    return files


def mxfp8(name: str, dtype: str, shape: tuple) -> list[tuple[str, str, tuple]]:
    """A BF16 2-D weight as the QAD export stores an MXFP8 one: E4M3 values + a UE8M0 byte per 32."""
    o, i = shape
    return [(name, "F8_E4M3", (o, i)), (name[: -len("weight")] + "weight_scale", "U8", (o, -(-i // 32)))]


def qad_layer(d: Dims, L: int) -> list[tuple[str, str, tuple]]:
    out = []
    for name, dt, shape in layer_tensors(d, L):
        module = name.split(f"layers.{L}.", 1)[1].rsplit(".", 1)[0]
        out += mxfp8(name, dt, shape) if module in QAD_MXFP8 else [(name, dt, shape)]
    return out


def qad_ple_table(d: Dims) -> list[tuple[str, str, tuple]]:
    b = f"{P}layers.1.ple.ple_embedding.ngram_embedding."
    out = []
    for i in range(d.ple_shards):
        out += [(f"{b}shard_{i}.weight", "U8", (d.ple_rows, d.ple_width // 2)),
                (f"{b}shard_{i}.weight_scale", "F8_E4M3", (d.ple_rows, d.ple_width // 16))]
    return out + [(f"{b}weight_scale_2", "F32", (1,))]


def w4a16_expert(prefix: str, d: Dims, e: int) -> list[tuple[str, str, tuple]]:
    """NVFP4 weights without an activation scale (the MTP experts, reported W4A16)."""
    return [t for t in nvfp4_expert(prefix, d, e) if not t[0].endswith("input_scale")]


def qad_files(d: Dims) -> dict[str, list]:
    emb, mixer = endpoints(d)
    seq = [emb[0]]
    for layer in range(d.layers):
        seq += qad_layer(d, layer) + [t for e in range(d.experts) for t in nvfp4_expert(f"{P}layers.{layer}.mlp", d, e)]
        if layer == 1:
            seq += ple_rest(d) + qad_ple_table(d)
    seq += [emb[1]] + mixer + mtp_nonexpert(d) + [t for e in range(d.experts) for t in w4a16_expert("mtp.layers.0.mlp", d, e)]
    seq += vision(d)
    per = -(-len(seq) // QAD_SHARDS)
    return {f"model-{k + 1:05d}-of-{QAD_SHARDS:05d}.safetensors": seq[k * per:(k + 1) * per] for k in range(QAD_SHARDS)}


def donor_files(d: Dims) -> dict[str, list]:
    return {"nvfp4_experts_mtp.safetensors":
            mtp_nonexpert(d) + [t for e in range(d.experts) for t in nvfp4_expert("mtp.layers.0.mlp", d, e)]}


FILES = {"radixark": radixark_files, "nvidia": nvidia_files, "donor": donor_files, "qad": qad_files}


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


# --- configs ----------------------------------------------------------------------------------

def configs(flavour: str, d: Dims) -> dict[str, str]:
    text = {"model_type": "qwen4_exp_text", "hidden_size": d.hidden, "num_hidden_layers": d.layers,
            "num_experts": d.experts, "vocab_size": d.vocab, "eos_token_id": 248044, "split_ngram_parts": d.ple_shards,
            "layer_types": [("full_attention" if is_qsa(i) else "linear_attention") for i in range(d.layers)],
            "mtp_num_hidden_layers": 1}
    producer = {"name": "modelopt", "version": "0.46.0"}
    if flavour == "radixark":
        text["ple_embedding_dtype"] = "float8_e4m3fn"
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "producer": producer,
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16,
                                                                               "dynamic": False},
                                            "input_activations": {"num_bits": 4, "type": "float", "group_size": 16,
                                                                  "dynamic": False}}},
              "ignore": list(IGNORE_13)}
        hq = {"producer": producer, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                     "exclude_modules": list(IGNORE_13)}}
    elif flavour == "nvidia":
        layers = {f"{P}layers.{i}.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16} for i in range(d.layers)}
        layers[f"{P}layers.1.ple.ple_embedding.ngram_embedding"] = {"quant_algo": "FP8"}
        ignore = ["lm_head", f"{P}embed_tokens", "model.visual*"] + [
            f"{P}layers.{i}.{m}*" for i in range(d.layers)
            for m in (("self_attn",) if is_qsa(i) else ("linear_attn",)) + ("mlp.shared_expert",)]
        qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "producer": producer,
              "quantized_layers": {**layers, "mtp.layers.0.mlp.experts": {"quant_algo": "FP8_PB_WO", "group_size": 128}},
              "ignore": ignore}
        hq = {"producer": producer, "quantization": {"quant_algo": "MIXED_PRECISION", "exclude_modules": ignore,
                                                     "quantized_layers": {**layers, "mtp.layers.0.mlp.experts":
                                                                          {"quant_algo": "FP8_BLOCK_SCALES", "group_size": 128}}}}
    elif flavour == "qad":
        experts = [f"{P}layers.{i}.mlp.experts" for i in range(d.layers)] + ["mtp.layers.0.mlp.experts"]
        mx = sorted(f"{P}layers.{i}.{m}" for i in range(d.layers) for m in QAD_MXFP8
                    if m.startswith("mlp.") or (m.startswith("self_attn.") == is_qsa(i)))
        layers = {e: {"quant_algo": "NVFP4", "group_size": 16} for e in experts}
        layers |= {m: {"quant_algo": "MXFP8", "group_size": 32} for m in mx}
        layers[f"{P}layers.1.ple.ple_embedding.ngram_embedding"] = {"quant_algo": "NVFP4", "group_size": 16}
        shared = [m for m in mx if ".shared_expert." in m]
        groups = {"group_nvfp4_routed_experts": {"targets": experts},
                  "group_mxfp8_attention": {"targets": [m for m in mx if m not in shared]},
                  "group_mxfp8_shared_experts": {"targets": shared}}
        qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "producer": producer,
              "config_groups": groups, "quantized_layers": layers, "ignore": []}
        hq = {"producer": producer, "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers,
                                                     "exclude_modules": []}}
    else:  # donor
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "calibration_applied": True,
              "ignore": ["lm_head", "model.visual.*"]}
        hq = {"producer": producer, "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    cfg = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp", "tie_word_embeddings": False,
           "text_config": text, "vision_config": {"depth": 27, "hidden_size": d.vis_hidden}, "quantization_config": qc}
    out = {
        "config.json": json.dumps(cfg, indent=2),
        "hf_quant_config.json": json.dumps(hq, indent=2),
        "generation_config.json": json.dumps({"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
                                              "temperature": 1.0, "top_k": 20, "top_p": 0.95}),
        "tokenizer.json": json.dumps({"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": {}, "merges": []}}),
        "tokenizer_config.json": json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
        "chat_template.jinja": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
        "preprocessor_config.json": json.dumps({"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}),
    }
    if flavour == "radixark":
        out["qualification-notes.md"] = "# qualification notes (synthetic)\n"
    if flavour == "qad":  # the export's own extra files: kept (serving reads none, the manifest is small)
        out["export-manifest.json"] = json.dumps({"producer": producer, "checkpoint": "synthetic qad"})
        out["video_preprocessor_config.json"] = json.dumps({"patch_size": 16})
        out["vocab.json"] = json.dumps({"a": 0})
        out["merges.txt"] = "#version: 0.2\n"
        out["README.md"] = "# synthetic QAD export (not a serving file)\n"
    return out


# --- writing ----------------------------------------------------------------------------------

def _random_array(dtype: str, shape: tuple, rng):
    import ml_dtypes
    import numpy as np

    n = _numel(shape)
    if dtype == "BF16":
        a = rng.standard_normal(n).astype(np.float32) * np.float32(0.02)
        if n >= 64:  # a few outliers: blocks must scale to their own amax
            a[rng.integers(0, n, max(1, n // 4096))] *= 40
        if n >= 256:
            a[:128] = 0  # an all-zero run (amax floor path) inside the first block row
        return a.astype(ml_dtypes.bfloat16).reshape(shape)
    if dtype == "F32":
        return (rng.random(n, dtype=np.float32) + np.float32(0.5)).reshape(shape)
    if dtype == "F8_E4M3":
        codes = rng.integers(0, 0x7E, n, dtype=np.uint8) | (rng.integers(0, 2, n, dtype=np.uint8) << 7)
        return codes.view(ml_dtypes.float8_e4m3fn).reshape(shape)
    if dtype == "U8":
        return rng.integers(0, 256, n, dtype=np.uint8).reshape(shape)
    if dtype == "I64":
        return rng.integers(1, 1 << 40, n, dtype=np.int64).reshape(shape)
    raise ValueError(dtype)


def write_safetensors(path: Path, tensors: list, sparse: bool, seed: int, values=None) -> None:
    """`values(name, dtype, shape, rng)`: the array for one tensor (default: `_random_array`)."""
    if sparse:
        entries = [stwriter.Entry(n, dt, tuple(s), DTYPE_BYTES[dt] * _numel(s)) for n, dt, s in sorted(tensors)]
        head = stwriter.header_bytes(entries, {"format": "pt"})
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(len(head) + sum(e.nbytes for e in entries))
        return
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    make = values or (lambda _n, dt, s, r: _random_array(dt, s, r))
    arrays = {n: make(n, dt, tuple(s), rng) for n, dt, s in tensors}
    if all(isinstance(a, np.ndarray) for a in arrays.values()):
        save_file(arrays, str(path), metadata={"format": "pt"})
        return
    import torch  # a value hook that made torch tensors (no ml_dtypes): write them all through torch
    from safetensors.torch import save_file as save_torch

    save_torch({n: a if isinstance(a, torch.Tensor) else torch.from_numpy(np.array(a, order="C"))  # keeps 0-d scalars 0-d
                for n, a in arrays.items()}, str(path), metadata={"format": "pt"})


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def revision_for(model: str, flavour: str, dims: Dims) -> str:
    return hashlib.sha1(f"{model}:{flavour}:{dims}".encode()).hexdigest()


def write_snapshot(cache: Path, flavour: str, dims: Dims = TINY, sparse: bool = False, model: str | None = None,
                   revision: str | None = None, seed: int = 0, values=None, small_files=None) -> Path:
    """Write a checkpoint into `<cache>/hub/models--…/{blobs,refs,snapshots}`; returns the snapshot.

    Blob names: sha256 for safetensors (sparse: sha256 of the header + size, not of the holes —
    the scale tier never runs --hash), git sha1 for small files, like the Hub's ETags.
    `values` replaces the random generator (see `write_safetensors`); `small_files(flavour, dims)`
    replaces `configs()` (tests/fakes/tiny_model.py uses both for a model vLLM can run).
    """
    model = model or {"radixark": RADIXARK, "nvidia": NVIDIA, "donor": DONOR, "qad": QAD}[flavour]
    files = FILES[flavour](dims)
    revision = revision or revision_for(model, flavour, dims)
    repo = Path(cache).expanduser() / "hub" / ("models--" + model.replace("/", "--"))
    blobs, snap = repo / "blobs", repo / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)

    def place(name: str, tmp: Path, blob: str) -> None:
        os.replace(tmp, blobs / blob)
        link = snap / name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blobs / blob, snap), link)

    weight_map = {}
    total = 0
    for i, (fname, tensors) in enumerate(sorted(files.items())):
        tmp = blobs / f".tmp-{fname}"
        write_safetensors(tmp, tensors, sparse, seed + i, values)
        size = tmp.stat().st_size
        total += size
        if sparse:
            with open(tmp, "rb") as f:
                head = f.read(8)
                head += f.read(int.from_bytes(head, "little"))
            blob = hashlib.sha256(head + str(size).encode()).hexdigest()
        else:
            blob = _sha256_file(tmp)
        place(fname, tmp, blob)
        for n, _, _ in tensors:
            weight_map[n] = fname
    small = (small_files or configs)("donor" if flavour == "donor" else flavour, dims)
    small["model.safetensors.index.json"] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                        indent=2)
    if flavour == "radixark":
        for fname in files:
            if fname.startswith("layer-"):
                small[fname.replace(".safetensors", ".complete.json")] = json.dumps({"file": fname, "ok": True})
    for name, text in small.items():
        data = text.encode()
        tmp = blobs / f".tmp-{name}"
        tmp.write_bytes(data)
        place(name, tmp, _git_sha1(data))
    return snap


def tensor_count(flavour: str, dims: Dims) -> int:
    files = FILES[flavour](dims)
    return sum(len(v) for v in files.values())


def with_layers(d: Dims, layers: int) -> Dims:
    return replace(d, layers=layers)
