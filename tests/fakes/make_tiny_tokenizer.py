"""Regenerate tests/fakes/data/tiny-tokenizer.json: a byte-level BPE tokenizer for the tiny e2e model.

Byte-level (any text encodes: the 256 byte tokens are ids 0..255, like Qwen's), trained with the
`tokenizers` library on the gates' own prompts and a little English so the fixed prompts encode
to no more tokens than Qwen's tokenizer gives them (prompt sizing never overshoots), then the 33
Qwen added tokens (`<|endoftext|>`, `<|im_start|>`, `<think>`, `<tool_call>`, ...) in Qwen's order.
Run with any Python that has `tokenizers` (the vllm tier's venvs do):
    python tests/fakes/make_tiny_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "data" / "tiny-tokenizer.json"
BASE_VOCAB = 2015  # + 33 added tokens = 2048 ids: the tiny model's vocab_size
ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
         "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
         "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
         "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
         "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
         "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>"]
# Qwen marks these (and the vision/audio ones) special; <tool_call>, <think> & co are added, not special.
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
               "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}


def corpus() -> list[str]:
    root = HERE.parents[1]
    texts = [(root / "src" / "flash_cli" / "gates" / "prompts.py").read_text()]
    texts.append((root / "README.md").read_text())
    texts.append("The capital of France is Paris. The weather in Paris is clear and 18 degrees. " * 4)
    return texts


def build() -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers.processors import ByteLevel as ByteLevelPost

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = ByteLevelPost(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BASE_VOCAB, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(corpus(), trainer=trainer)
    from tokenizers import AddedToken
    tok.add_tokens([AddedToken(t, special=t not in NOT_SPECIAL, normalized=False) for t in ADDED])
    return tok.to_str(pretty=True)


if __name__ == "__main__":
    text = build()
    OUT.write_text(text)
    vocab = json.loads(text)["model"]["vocab"]
    added = json.loads(text)["added_tokens"]
    print(f"{OUT}: {len(vocab)} BPE ids + {len(added)} added tokens, first added id {added[0]['id']}")
