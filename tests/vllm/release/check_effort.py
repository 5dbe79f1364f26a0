"""Patch 12 (v0.29-v0.32) / `--reasoning-effort-map` (v0.33): rendering through the real
template-kwargs path and transformers' Jinja renderer, with a template that refuses efforts the
way the Qwen3.8-Flash-Next template does."""

from __future__ import annotations

import pytest

from flash_common import releases

TEMPLATE = (
    "{%- set effort = reasoning_effort | default('xhigh') -%}"
    "{%- if effort not in ['xhigh', 'medium', 'low'] -%}"
    "{{ raise_exception('Unexpected reasoning effort ' + effort + '. Supported types are xhigh (default), medium, and low.') }}"
    "{%- endif -%}"
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}{%- endfor -%}"
    "<|assistant|><effort={{ effort }}>"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def render(tokenizer, base, effort):
    from vllm.renderers.hf import resolve_chat_template_kwargs

    kwargs = {"reasoning_effort": effort}
    if releases.has(base, "reasoning_effort_map"):  # native: the run spec passes --reasoning-effort-map with our map
        from vllm.renderers.params import map_reasoning_effort

        from flash_vllm.patches.p12_effort_alias import EFFORT_MAP

        kwargs["reasoning_effort"] = map_reasoning_effort(effort, EFFORT_MAP)
    resolved = resolve_chat_template_kwargs(tokenizer, TEMPLATE, kwargs)
    return tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=TEMPLATE,
                                         tokenize=False, **resolved)


@pytest.mark.parametrize("effort, rendered", [
    ("high", "xhigh"), ("max", "xhigh"), ("minimal", "low"),
    ("xhigh", "xhigh"), ("medium", "medium"), ("low", "low"),
])
def test_aliases_render(registered, tokenizer, base, effort, rendered):
    out = render(tokenizer, base, effort)
    assert out.endswith(f"<effort={rendered}>")


def test_unknown_effort_still_reaches_the_template(registered, tokenizer, base):
    with pytest.raises(Exception, match="Unexpected reasoning effort bogus"):
        render(tokenizer, base, "bogus")


def test_other_efforts_render_byte_identically(registered, tokenizer, base):
    import vllm.renderers.hf as hf

    fn = hf.resolve_chat_template_kwargs
    if releases.has(base, "reasoning_effort_map"):
        assert not hasattr(fn, "__flash_patch__")
        return
    assert fn.__flash_patch__ == 12
    for effort in ("xhigh", "medium", "low", None):
        kw = {"reasoning_effort": effort}
        assert fn(tokenizer, TEMPLATE, dict(kw)) == fn.__flash_original__(tokenizer, TEMPLATE, dict(kw))
