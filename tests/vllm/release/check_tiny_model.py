"""The tiny e2e model (tests/fakes/tiny_model.py, built by the outer test and passed in
FLASH_TEST_TINY_MODELS as a, b, c) meets this release's own code on CPU:
- vLLM's config parsing builds a ModelConfig for each layout (architecture, max_model_len, the
  quantization method it picks, the vocabulary);
- vLLM's tokenizer loader loads the tokenizer offline and renders a chat prompt;
- `Qwen4ExpNGramEmbedding._make_layer_multipliers/_make_vocab_layout` for the config equal the I64
  buffers written into the checkpoint (the values the stock `load_weights` path receives)."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch

PLE = "model.language_model.layers.1.ple.ple_embedding."


def _snaps() -> dict[str, Path]:
    raw = os.environ.get("FLASH_TEST_TINY_MODELS", "")
    paths = [Path(p) for p in raw.split(os.pathsep) if p]
    assert len(paths) == 3, ("FLASH_TEST_TINY_MODELS must name the a, b, c tiny models; run through "
                             "tests/vllm/test_releases.py, which builds them with tests/fakes/tiny_model.py")
    return dict(zip("abc", paths))


def _ngram_class():
    for mod in ("vllm.models.qwen4_exp.nvidia.ngram_embedding", "vllm.models.qwen4_exp.nvidia.ple_layer"):
        try:
            cls = getattr(importlib.import_module(mod), "Qwen4ExpNGramEmbedding", None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    raise AssertionError("this release has no Qwen4ExpNGramEmbedding where 0.29-0.33 keep it")


@pytest.mark.parametrize("key", ["a", "b", "c"])
def test_model_config_accepts_the_layout(key):
    from vllm.config import ModelConfig

    snap = str(_snaps()[key])
    mc = ModelConfig(model=snap, tokenizer=snap, dtype="auto", max_model_len=2048, trust_remote_code=False)
    assert mc.architectures == ["Qwen4ExpForConditionalGeneration"]
    assert mc.max_model_len == 2048
    assert mc.quantization in ("modelopt", "modelopt_fp4", "modelopt_mixed"), mc.quantization
    text = json.loads((Path(snap) / "config.json").read_text())["text_config"]
    assert mc.get_vocab_size() == text["vocab_size"]


def test_tokenizer_loads_offline_and_renders_a_chat_prompt():
    from vllm.tokenizers import get_tokenizer

    snap = str(_snaps()["a"])
    tok = get_tokenizer(snap)
    prompt = tok.apply_chat_template([{"role": "user", "content": "The capital of France is"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert prompt.endswith("<think>\n") and ids and max(ids) < 2048
    assert len(tok) <= 2048


@pytest.mark.parametrize("key", ["a", "c"])
def test_ngram_layout_equals_the_checkpoint_buffers(key):
    from safetensors import safe_open

    snap = _snaps()[key]
    text = json.loads((snap / "config.json").read_text())["text_config"]
    cls = _ngram_class()
    heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
    mult = cls._make_layer_multipliers(ngram_size=text["ngram_size"], unigram_vocab_size=text["vocab_size"],
                                       seed=text.get("seed", 1234), ple_dense_layer_id=0)
    sizes, offsets, total = cls._make_vocab_layout(ngram_vocab_size_base=text["ngram_vocab_size_base"],
                                                   ngram_heads=heads, ple_dense_layer_id=0)
    index = json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"]
    got = {}
    for leaf in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"):
        with safe_open(str(snap / index[PLE + leaf]), "pt") as f:
            got[leaf] = f.get_tensor(PLE + leaf)
    assert torch.equal(got["layer_multipliers"], torch.tensor(mult, dtype=torch.long))
    assert torch.equal(got["ngram_heads_offsets"], torch.tensor(offsets, dtype=torch.long))
    assert torch.equal(got["ngram_heads_vocab_sizes"], torch.tensor(sizes, dtype=torch.long))
    div = text["make_ngram_vocab_size_divisible_by"]
    padded = -(-total // div) * div
    rows = 0
    for name, fname in index.items():
        if ".ngram_embedding.shard_" in name:
            with safe_open(str(snap / fname), "pt") as f:
                rows += f.get_slice(name).get_shape()[0]
    assert rows == padded
