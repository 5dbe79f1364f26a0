"""Every profile's parsers exist in the release its base runs: the `--tool-call-parser` (TOOL_PARSER:
qwen3_coder, or NVIDIA's qwen3_xml) and `--reasoning-parser` values of the argv flash renders, looked
up in the release's own parser managers. A name the release lacks fails `vllm serve` at boot, after
the weights have loaded."""

from __future__ import annotations

import importlib

from flash_cli import layout, profiles, spec
from flash_cli.errors import ConfigError
from flash_cli.settings import resolve


def _tool_parsers():
    for where in ("vllm.tool_parsers", "vllm.entrypoints.openai.tool_parsers"):  # 0.30+ / 0.29
        try:
            return importlib.import_module(where).ToolParserManager
        except ImportError:
            continue
    raise AssertionError("this release has no ToolParserManager where vLLM 0.29-0.33 keep it")


def _rendered(base):
    """{profile: (tool parser, reasoning parser)} as rendered with BASE set to this release's base
    (a user may run any profile on any base); profiles that refuse that base are left out."""
    out = {}
    for name in profiles.names():
        p = profiles.load(name)
        parallel = p.values.get("PARALLEL", "none")
        n = 1 if parallel == "none" else layout.parse(parallel).boxes
        nodes = {} if n == 1 else {"NODES": ",".join("abcd"[:n]),
                                   "NODE_ADDRS": ",".join(f"10.0.0.{i + 1}" for i in range(n))}
        try:
            s = resolve(p.layer(), {}, {**nodes, "BASE": base}, profile_name=name)
            argv = spec.vllm_args(s, "0" * 40, "127.0.0.1", 18300)
        except ConfigError:  # e.g. a setting this base has no code for: flash refuses, nothing to boot
            continue
        last = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}  # argparse keeps the last
        out[name] = (last["--tool-call-parser"], last["--reasoning-parser"])
    return out


def test_each_profile_names_parsers_this_release_has(base):
    from vllm.reasoning import ReasoningParserManager

    rendered = _rendered(base)
    assert "default" in rendered and "nvidia" in rendered, sorted(rendered)  # both parsers on every base
    tools = _tool_parsers()
    for name, (tool, reasoning) in sorted(rendered.items()):
        assert tools.get_tool_parser(tool) is not None, (name, tool)
        assert ReasoningParserManager.get_reasoning_parser(reasoning) is not None, (name, reasoning)


def test_an_unknown_parser_name_is_refused(base):
    """The lookups above can fail: the managers raise on a name they do not know."""
    import pytest

    with pytest.raises(KeyError):
        _tool_parsers().get_tool_parser("no_such_parser")
