"""Issue 16 against the real release: the argv our run spec renders for EFFORT_DEFAULT,
MTP_BY_BATCH and MTP_BLOCK_DROP goes through this release's own `vllm serve` argument parser,
its SpeculativeConfig fields, its dynamic-SD schedule validator and its chat-params merge; and
the release catalogue (flash_common.releases: what the host believes about this base) matches what is really there."""

from __future__ import annotations

import dataclasses
import json

import pytest

SNAP = "0123456789abcdef0123456789abcdef01234567"
TEMPLATE = (
    "{%- set effort = reasoning_effort | default('xhigh') -%}"
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}{%- endfor -%}"
    "<|assistant|><effort={{ effort }}>"
)


@pytest.fixture(scope="module")
def serve_parser(serve_cli):
    """The release's full `vllm serve` parser (frontend + engine arguments)."""
    return serve_cli.parser


def our_argv(base: str, **overrides: str) -> list[str]:
    from flash_cli import spec
    from flash_cli.settings import resolve

    s = resolve(overrides={"BASE": base, **overrides})
    return spec.vllm_args(s, SNAP, "0.0.0.0", 8000)[2:]  # without "vllm serve"


def spec_fields() -> set[str]:
    from vllm.config import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def test_catalogue_speculative_caps_match_this_release(base):
    from flash_common import releases

    fields = spec_fields()
    assert releases.has(base, "spec_tokens_per_batch_size") == ("num_speculative_tokens_per_batch_size" in fields)
    assert releases.has(base, "spec_eagle_block_drop_flag") == ("disable_eagle_block_drop" in fields)


def test_speculative_config_refuses_unknown_keys(base):
    """Why the host refuses MTP_BLOCK_DROP=0 where the field is absent: the boot would fail."""
    import pydantic
    from vllm.config import SpeculativeConfig

    with pytest.raises(pydantic.ValidationError, match="flash_no_such_key"):
        SpeculativeConfig(method="mtp", num_speculative_tokens=2, flash_no_such_key=True)


def test_rendered_speculative_config_parses_into_real_fields(serve_parser, base):
    from flash_common import releases

    over = {"MTP": "3", "MTP_BY_BATCH": "1:3,3:2,6:1", "SEQS": "8"}
    if releases.has(base, "spec_eagle_block_drop_flag"):
        over["MTP_BLOCK_DROP"] = "0"
    args = serve_parser.parse_args(our_argv(base, **over))
    sc = args.speculative_config
    sc = json.loads(sc) if isinstance(sc, str) else sc
    assert sc["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 5, 2], [6, 8, 1]]
    assert set(sc) <= spec_fields(), set(sc) - spec_fields()
    assert sc.get("disable_eagle_block_drop", False) == ("MTP_BLOCK_DROP" in over)


def test_schedule_through_vllms_own_validator_and_lookup():
    from vllm.v1.spec_decode.dynamic.utils import (build_dynamic_sd_schedule_lookup,
                                                    validate_and_normalize_dynamic_sd_schedule)

    from flash_cli import spec
    from flash_cli.settings import resolve

    schedule = spec.mtp_schedule(resolve(overrides={"MTP": "3", "MTP_BY_BATCH": "1:3,3:2,6:1", "SEQS": "8"}))
    assert validate_and_normalize_dynamic_sd_schedule(schedule) == [tuple(r) for r in schedule]
    # what the scheduler will use per number of running requests (index = batch size)
    assert build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=8, vllm_num_speculative_tokens=3)[1:] == \
        [3, 3, 2, 2, 2, 1, 1, 1]
    # a K above MTP: we render it capped, exactly what vLLM's lookup would do with the raw value
    capped = spec.mtp_schedule(resolve(overrides={"MTP": "2", "MTP_BY_BATCH": "1:3,3:1", "SEQS": "4"}))
    raw = [[1, 2, 3], [3, 4, 1]]
    assert build_dynamic_sd_schedule_lookup(capped, 4, 2) == build_dynamic_sd_schedule_lookup(raw, 4, 2)


@pytest.mark.parametrize("bad", [[[2, 4, 1]], [[1, 3, 2], [3, 5, 1]]])
def test_what_we_refuse_vllm_refuses_too(bad):
    """Our refusals (first range at 1; rising starts) are vLLM's rules, met before the boot."""
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    with pytest.raises(ValueError):
        validate_and_normalize_dynamic_sd_schedule(bad)


def test_default_effort_reaches_the_template_and_requests_still_win(serve_parser, base):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.hf import resolve_chat_template_kwargs

    from flash_cli.spec import DEFAULT_CHAT_TEMPLATE_KWARGS

    argv = our_argv(base, EFFORT_DEFAULT="medium")
    assert DEFAULT_CHAT_TEMPLATE_KWARGS in argv
    defaults = serve_parser.parse_args(argv).default_chat_template_kwargs
    assert defaults == {"reasoning_effort": "medium"}

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")

    def rendered(**request) -> str:
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **request)
        params = req.build_chat_params(TEMPLATE, "auto").with_defaults(defaults)  # what the chat serving does
        kwargs = resolve_chat_template_kwargs(tokenizer, TEMPLATE, params.chat_template_kwargs)
        return tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=TEMPLATE,
                                             tokenize=False, **kwargs)

    assert rendered().endswith("<effort=medium>")  # no effort in the request: the server default
    assert rendered(reasoning_effort="low").endswith("<effort=low>")  # the request's own wins
