"""Run inside a release venv by tests/vllm/test_gpu_e2e_triggers.py; prints one JSON line of facts.

    p3  (TRITON_INTERPRET=1): the gpu-e2e Mamba fault injection (tests/gpu_e2e/inject) installed on the
        release's real mamba_utils the way the server's sitecustomize does (at import, before the plugin),
        then patch 3 through the registry; a real MambaSpecDecodeGPUContext over the CPU world of
        release/mamba_guard_interp.py runs the real (guarded) precopy kernel in Triton's interpreter.
    p13: the gpu-e2e patch-13 request (tests/gpu_e2e/triggers.py) through the release's own request
        model, parser composition (qwen3_coder + qwen3, as the recipe serves), adjust_request, sampling
        params, xgrammar backend (the server's compile path), a constrained decode that picks random
        allowed tokens (any tokenization the model could choose), and the chat server's non-streaming
        parse + message assembly; with patch 13 applied or not (argv[2] on|off).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "tests" / "gpu_e2e" / "inject", ROOT / "tests" / "gpu_e2e", HERE / "release"):
    sys.path.insert(0, str(p))


def _apply(n: int) -> None:
    from flash_vllm import compat
    from flash_vllm.registry import Context, by_number

    patch = by_number(n)
    c = Context(compat.resolve(compat.installed_vllm_version(), {}), {})
    patch.check(c)
    patch.apply(c)
    patch.verify(c)


def p3() -> dict:
    import torch

    import flash_e2e_mamba_inject as inj
    import triggers
    from vllm.v1.worker import mamba_utils as mu

    facts: dict = {"triton_interpret": os.environ.get("TRITON_INTERPRET", "")}
    lines: list[str] = []
    inj.say = lambda kind, what: lines.append(f"{kind}: {what if isinstance(what, str) else json.dumps(what)}")
    # a moved anchor refuses (what the server prints instead of injecting)
    saved = dict(inj.ANCHORS)
    inj.ANCHORS[inj.LAUNCHER] = ("precopy_mamba_align_fused_kernel[grid](", "self.moved_block_table_ptrs,")
    try:
        inj.install(mu)
        facts["moved_anchor"] = "installed"
    except inj.Refused as exc:
        facts["moved_anchor"] = str(exc)
    inj.ANCHORS.clear()
    inj.ANCHORS.update(saved)
    facts["init_wrapped_before"] = getattr(mu.MambaSpecDecodeGPUContext.initialize_from_forward_context,
                                           "__flash_e2e_inject__", False)
    inj.install(mu, bad=triggers.BAD_BLOCK_ID)   # the server's order: at import, before the plugin
    inj.install(mu, bad=triggers.BAD_BLOCK_ID)   # idempotent
    _apply(3)                                    # patch 3's check still passes with the injection in
    facts["launcher_patch"] = getattr(mu.MambaSpecDecodeGPUContext.run_fused_precopy, "__flash_patch__", None)
    facts["init_params"] = list(__import__("inspect").signature(
        mu.MambaSpecDecodeGPUContext.initialize_from_forward_context.__wrapped__).parameters)

    import mamba_guard_interp as w
    from flash_vllm.patches import p03_mamba_copy_guard as g

    dev = torch.device("cpu")
    states = w.world(dev)
    initial = w.cpu(states)
    # r0: no copy (fresh: src -1); r1: crosses from column 0 to 1 (group 0 ids 3 -> 4, group 1 ids 5 -> 6);
    # r2: stays in its column (no copy). V2 passes an idx_mapping: batch order 2, 0, 1.
    rows = [([1, 0, 0, 0, 0], [1, 0, 0, 0, 0]), ([3, 4, 0, 0, 0], [5, 6, 0, 0, 0]), ([7, 8, 0, 0, 0], [7, 8, 0, 0, 0])]
    order = [2, 0, 1]   # batch -> request
    row_by = inj.check(mu)
    facts["row_by"] = row_by
    # the tables as the release lays them out: per request slot (0.33) or in batch order (0.29)
    tables = w.tables_for(rows if row_by == "req_idx" else [rows[r] for r in order], dev)
    before = [t.clone() for t in tables]
    ctx = w.make_ctx(mu, states, tables, dev)
    facts["instance_wrapped"] = getattr(ctx.__dict__.get(inj.LAUNCHER), "__flash_e2e_inject__", False)
    guard = g.guard_of(ctx)

    def launch(src, dst):
        ctx.run_fused_precopy(num_reqs=3, state_idx_gpu=w.i32(dst, dev), src_col_gpu=w.i32(src, dev),
                              token_bias_gpu=w.i32([0, 0, 0], dev), idx_mapping=w.i32(order, dev))

    launch([-1, -1, 0], [0, 0, 0])   # nothing crosses: no injection
    facts["after_quiet_launch"] = {"lines": [x for x in lines if x.startswith("fired")], "counter": int(guard.counter)}
    launch([-1, 0, 0], [0, 1, 0])    # r1 crosses: the injection fires on group 0, row 1, column 1
    after = w.cpu(states)
    facts["fired"] = [x for x in lines if x.startswith("fired")]
    facts["counter_after_injection"] = int(guard.counter)
    facts["tables_restored"] = all(torch.equal(a, b) for a, b in zip(before, tables))
    facts["group0_dst_untouched"] = all(torch.equal(after[0][s][4], initial[0][s][4]) for s in (0, 1))
    facts["group1_copied"] = all(torch.equal(after[1][s][6], initial[1][s][5]) for s in (0, 1))
    launch([-1, 0, 0], [0, 1, 0])    # the same crossing again: no second injection, the copy happens
    again = w.cpu(states)
    facts["fired_count"] = sum(x.startswith("fired") for x in lines)
    facts["counter_after_second"] = int(guard.counter)
    facts["group0_copied_second_time"] = all(torch.equal(again[0][s][4], initial[0][s][3]) for s in (0, 1))
    facts["ready"] = [x for x in lines if x.startswith("ready")]
    # the guard's own report line, as the server would log it
    import logging

    report: list[str] = []
    h = logging.Handler()
    h.emit = lambda rec: report.append(rec.getMessage())
    logging.getLogger("vllm.flash").addHandler(h)
    guard.poll(now=guard._next + 1)
    facts["guard_report"] = report
    facts["guard_counts"] = triggers.guard_counts("\n".join(report))
    return facts


def p13(on: bool) -> dict:
    import triggers
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.entrypoints.openai.chat_completion.message_assembly import assemble_chat_message_fields
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
    from vllm.config import StructuredOutputsConfig
    from types import SimpleNamespace

    if on:
        _apply(13)
    # the API server's validation imports every backend's validator; the CPU venv lacks the two
    # backends "auto" never picks for a grammar (lm-format-enforcer, outlines): empty stand-ins
    import importlib.util
    import types

    class _Absent(types.ModuleType):
        def __getattr__(self, item):  # annotations and isinstance targets at import time only
            if item.startswith("__"):
                raise AttributeError(item)
            return type(item, (), {})

    for name in ("lmformatenforcer", "outlines_core"):
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = _Absent(name)
    tok = get_tokenizer(os.environ["FLASH_TINY_TOKENIZER"])
    specials = {t: tok.convert_tokens_to_ids(t) for t in triggers.SPECIAL}
    pcls = ParserManager.get_parser(tool_parser_name="qwen3_coder", reasoning_parser_name="qwen3",
                                    enable_auto_tools=True, tokenizer=tok)
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vocab = json.loads((Path(os.environ["FLASH_TINY_TOKENIZER"]) / "config.json").read_text())["text_config"]["vocab_size"]
    backends = {"xgrammar": lambda: XgrammarBackend(cfg, tok, vocab), "guidance": lambda: GuidanceBackend(cfg, tok, vocab)}
    stops = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    out = {"patch13": on, "special_ids": specials, "cases": {}}
    for case in triggers.P13_CASES:
        body = triggers.p13_body("m", case)
        req = ChatCompletionRequest(**body)
        kwargs = body["chat_template_kwargs"]
        parser = pcls(tok, req.tools, chat_template_kwargs=kwargs, model_config=None)
        req = parser.adjust_request(req)
        prompt = tok.apply_chat_template(body["messages"], tools=body["tools"], tokenize=False,
                                         add_generation_prompt=True, **kwargs)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        sp = req.to_sampling_params(body["max_tokens"], {})
        so = sp.structured_outputs
        # the API server's check picks the backend ("auto", the recipe's: xgrammar when its validation
        # passes, else guidance), then the engine compiles with that backend's class
        sp._validate_structured_outputs(SimpleNamespace(is_diffusion=False), StructuredOutputsConfig(), tok)
        backend = backends[so._backend]()
        mask = backend.allocate_token_bitmask(1)
        runs = []
        for seed in range(3):  # a fresh matcher per run, as per request in the engine
            grammar = backend.compile_grammar(StructuredOutputOptions.GRAMMAR, so.grammar, stop_token_ids=stops)
            rng, ids = random.Random(seed), []
            while not grammar.is_terminated() and len(ids) < body["max_tokens"]:
                grammar.fill_bitmask(mask, 0)
                allowed = [i for i in range(vocab) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
                t = rng.choice(allowed)
                assert grammar.accept_tokens("r", [t])
                ids.append(t)
            out_ids = [i for i in ids if i not in stops]  # the stop token ends the output; not in the text
            text = tok.decode(out_ids, skip_special_tokens=sp.skip_special_tokens)
            p = pcls(tok, req.tools, chat_template_kwargs=kwargs, model_config=None)
            p.set_prompt_token_ids(prompt_ids)
            reasoning, content, calls = p.parse(text, req, enable_auto_tools=True, model_output_token_ids=out_ids)
            fields = assemble_chat_message_fields(req, reasoning, content, calls, enable_auto_tools=True,
                                                  parser_cls=pcls)
            message = {"content": fields.content,
                       "tool_calls": [{"function": {"name": c.function.name, "arguments": c.function.arguments}}
                                      for c in (fields.tool_calls or [])]}
            runs.append({"text": text, "special_ids_in_output": [i for i in out_ids if i in specials.values()],
                         "tokens": len(ids), "reasoning": fields.reasoning, "message": message,
                         "verdict": triggers.p13_verdict(case, message)})
        out["cases"][case] = {"grammar": so.grammar, "backend": so._backend, "regex": so.regex, "structural_tag": so.structural_tag,
                              "skip_special_tokens": sp.skip_special_tokens,
                              "reasoning_ended": req.resolve_reasoning_ended(parser, prompt_ids),
                              "prompt_tail": prompt[-40:], "runs": runs}
    return out


if __name__ == "__main__":
    mode = sys.argv[1]
    facts = p3() if mode == "p3" else p13(sys.argv[2] == "on")
    print(json.dumps(facts, default=str))
