"""The tiny e2e model (tests/fakes/tiny_model.py): the four layouts pass our own verify, stay small,
carry the exact PLE buffers, and transformers' real qwen4_exp accepts the config, the tokenizer and
every BF16 tensor's name and shape (the vllm tier checks the same files against vLLM's code)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fakes import ckpt, tiny_model
from flash_cli.checkpoint import verify
from flash_vllm.ple.hashing import PLELayout
from flash_common.stheader import read_header

PLE = "model.language_model.layers.1.ple.ple_embedding."


@pytest.fixture(scope="module")
def snaps(tmp_path_factory):
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "hf")


def _tensor(path, name):
    h = read_header(path)
    t = h.tensors[name]
    raw = np.fromfile(path, dtype=np.uint8, count=t.nbytes, offset=t.begin)
    return raw, t


def test_four_layouts_verify_and_stay_small(snaps):
    for key, d in snaps.items():
        res = verify.verify(d, with_hash=key == "a")
        assert res.ok, (key, res.problems)
        assert tiny_model.served_bytes(d) <= tiny_model.MAX_MB * 10**6, (key, tiny_model.served_bytes(d))
    assert snaps["b"].name.endswith("-fp8hybrid") and snaps["c"].name.endswith("-fp8hybrid-mtpnvfp4")


def test_flash_verify_cli_accepts_each(snaps):
    cache = snaps["a"].parents[3]
    for key in "abcd":
        words = [f"{k}={v}" for k, v in tiny_model.recipe_for(key, snaps).items()]
        proc = subprocess.run([sys.executable, "-m", "flash_cli", "verify", "--no-profile", f"HF_CACHE={cache}", *words],
                              capture_output=True, text=True)
        assert proc.returncode == 0, (key, proc.stdout, proc.stderr)


def test_ple_buffers_are_the_exact_layout(snaps):
    cfg = json.loads((snaps["a"] / "config.json").read_text())
    lay = PLELayout.from_config(cfg, 0)
    index = json.loads((snaps["a"] / "model.safetensors.index.json").read_text())["weight_map"]
    got = {}
    for leaf in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"):
        raw, t = _tensor(snaps["a"] / index[PLE + leaf], PLE + leaf)
        assert t.dtype == "I64"
        got[leaf] = raw.view(np.int64).tolist()
    lay.check_buffers(**got)  # raises on any difference
    # the table's shards cover the padded layout exactly
    shards = [k for k in index if k.startswith(PLE + "ngram_embedding.shard_")]
    assert len(shards) == lay.num_shards == cfg["text_config"]["split_ngram_parts"]
    _, t = _tensor(snaps["a"] / index[shards[0]], shards[0])
    assert tuple(t.shape) == (lay.rows_per_shard, lay.head_dim) and lay.rows_per_shard * lay.num_shards == lay.num_rows
    # NVFP4 block scales are positive finite e4m3, the table's fp8 codes finite
    name = "model.language_model.layers.0.mlp.experts.0.gate_proj.weight_scale"
    raw, _ = _tensor(snaps["a"] / index[name], name)
    assert (raw & 0x80).max() == 0 and (raw & 0x7F).max() < 0x7F and raw.min() > 0


def test_qsa_topk_and_tokenizer_traps(snaps):
    text = json.loads((snaps["a"] / "config.json").read_text())["text_config"]
    assert text["indexer_budget"] // text["indexer_compress_ratio"] in (512, 1024, 2048)
    tok = json.loads((snaps["a"] / "tokenizer.json").read_text())
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok["added_tokens"]]
    assert max(ids) < text["vocab_size"] and len(set(ids)) == len(ids)
    assert text["eos_token_id"] == tiny_model.added_tokens()["<|endoftext|>"]


def test_transformers_accepts_config_tokenizer_and_bf16_shapes(snaps):
    transformers = pytest.importorskip("transformers", minversion="5.16")  # pinned in the test extra
    import torch

    for key in "abc":
        cfg = transformers.AutoConfig.from_pretrained(snaps[key])
        assert type(cfg).__name__ == "Qwen4ExpConfig"
    tok = transformers.AutoTokenizer.from_pretrained(snaps["a"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "The capital of France is"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    ids = tok(prompt)["input_ids"]
    assert tok.decode(ids) == prompt and max(ids) < cfg.text_config.vocab_size
    assert tok.convert_tokens_to_ids(["<think>", "<tool_call>"]) == [tiny_model.added_tokens()[t] for t in ("<think>", "<tool_call>")]

    cfg = transformers.AutoConfig.from_pretrained(snaps["a"])
    model = transformers.Qwen4ExpForConditionalGeneration(cfg)
    state = model.state_dict()
    index = json.loads((snaps["a"] / "model.safetensors.index.json").read_text())["weight_map"]
    checked = 0
    for name, fname in index.items():
        t = read_header(snaps["a"] / fname).tensors[name]
        if (t.dtype not in ("BF16", "F32", "I64") or name.startswith("mtp.") or ".experts." in name
                or name.endswith("weight_scale")):  # a quantization scale is no transformers parameter
            continue
        assert name in state, name
        assert list(state[name].shape) == list(t.shape), (name, t.shape, state[name].shape)
        checked += 1
    assert checked > 100
    # transformers computes the PLE buffers itself: ours equal them
    for leaf in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"):
        raw, _ = _tensor(snaps["a"] / index[PLE + leaf], PLE + leaf)
        assert torch.equal(state[PLE + leaf], torch.from_numpy(raw.view(np.int64).copy())), leaf
    rows = sum(read_header(snaps["a"] / index[k]).tensors[k].shape[0] for k in index if ".ngram_embedding.shard_" in k)
    assert rows == state[PLE + "ngram_embedding.weight"].shape[0]


def test_dims_defaults_keep_the_old_fakes():
    assert ckpt.TINY.head_dim == 256 and ckpt.TINY.vis_blocks == 27  # TINY/REAL unchanged by the new fields


def test_same_bytes_without_ml_dtypes(snaps, tmp_path):
    """The GPU device's vLLM env has torch but not ml_dtypes: there the writer (and the hybrid's fp8
    cast) go through torch, and every file comes out byte-identical."""
    code = ("import runpy, sys; sys.modules['ml_dtypes'] = None; sys.argv = ['tiny_model.py', sys.argv[1]]; "
            f"runpy.run_path({str(tiny_model.HERE / 'tiny_model.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hf")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = snaps["a"].parents[3]
    compared = 0
    for f in sorted(ours.rglob("*")):
        if f.is_file() and f.suffix in (".safetensors", ".json") and ".tmp" not in f.name:
            other = tmp_path / "hf" / f.relative_to(ours)
            assert other.read_bytes() == f.read_bytes(), f.relative_to(ours)
            compared += 1
    assert compared > 40
