"""The gpu-e2e scenarios guard_p3 and guard_p13, proven on CPU with each release's real code, so a GPU
run only confirms (tests/vllm/gpu_e2e_triggers_in_release.py does the work inside the release venv).

- guard_p3: the test-only injection (tests/gpu_e2e/inject) finds its anchors in the release's
  mamba_utils, wraps the context whose `block_table_ptrs` the fused kernels read, leaves patch 3's
  registration intact, fires once at the first precopy launch that copies (V2's idx_mapping batch),
  and the real guarded kernel (Triton's interpreter) skips exactly that request's copies in the
  corrupted group and counts them: the guard's own report line says N >= 1. A moved anchor refuses.
- guard_p13: fleet's request (triggers.p13_body) through the release's request model, parser
  composition, backend selection ("auto" -> guidance: xgrammar's validator rejects special-token
  syntax), the engine's grammar and a constrained decode choosing random allowed tokens, then the chat
  server's parse: the markers come out as their special token ids; with patch 13 the content is the
  whole text and no tool call comes out, without it the answer is cut (and the fenced example becomes
  a get_weather call).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from release_envs import ensure

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gpu_e2e"))
import triggers  # noqa: E402

pytestmark = pytest.mark.vllm
SCRIPT = HERE / "gpu_e2e_triggers_in_release.py"


def _run(version: str, *args: str, **env: str) -> dict:
    rt = ensure(version)
    proc = subprocess.run([rt["python"], str(SCRIPT), *args], env={**rt["env"], **env}, capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The tiny model's tokenizer files (what every fleet server serves), without its weights."""
    from fakes import tiny_model

    files = tiny_model.small_files("nvidia", tiny_model.dims())
    d = tmp_path_factory.mktemp("tiny-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        (d / name).write_text(files[name])
    return d


@pytest.mark.parametrize("version", ["0.29.0", "0.33.0"])
def test_mamba_injection_reaches_patch_3s_guard(version):
    f = _run(version, "p3", TRITON_INTERPRET="1")
    assert f["triton_interpret"] == "1"
    assert "no longer contains" in f["moved_anchor"]              # a source move refuses, on CPU
    # the wrapped method hands over the tables the kernels read (its arguments include them)
    assert "block_tables" in f["init_params"]
    assert f["launcher_patch"] == 3 and f["instance_wrapped"]     # patch 3 applied over the injection
    assert f["ready"] and json.loads(f["ready"][0].split(": ", 1)[1])["launcher_patched_by"] == 3
    assert f["after_quiet_launch"] == {"lines": [], "counter": 0}  # no copy in the launch: nothing injected
    assert len(f["fired"]) == 1 and f["fired_count"] == 1           # once
    fired = json.loads(f["fired"][0].split(": ", 1)[1])
    # the row the kernel reads for request 1 (batch position 2): its slot on 0.33, its batch row on 0.29
    assert f["row_by"] == {"0.29.0": "batch_idx", "0.33.0": "req_idx"}[version]
    assert fired == {"group": 0, "row": 1 if f["row_by"] == "req_idx" else 2, "src_col": 0, "dst_col": 1, "block_id": 4,
                     "bad_block_id": triggers.BAD_BLOCK_ID, "num_reqs": 3, "states": 4, "v2_idx_mapping": True}
    assert f["counter_after_injection"] == 2                         # group 0's conv + temporal copies skipped
    assert f["group0_dst_untouched"] and f["group1_copied"] and f["tables_restored"]
    assert f["counter_after_second"] == 2 and f["group0_copied_second_time"]
    assert f["guard_counts"] == [2] and triggers.guard_counts("\n".join(f["guard_report"])) == [2]


# 0.33.0 only: the script drives 0.33's chat-serving pieces (message_assembly and the parser composition
# as 0.33 lays them out); 0.29.0's serving module is organised differently and is not covered, so on a
# 0.29 fleet guard_p13 runs unproven on CPU.
@pytest.mark.parametrize("patch13", ["on", "off"])
@pytest.mark.parametrize("version", ["0.33.0"])
def test_forced_reply_reaches_patch_13s_trigger(version, patch13, tokenizer_dir):
    f = _run(version, "p13", patch13, FLASH_TINY_TOKENIZER=str(tokenizer_dir))
    assert set(f["cases"]) == set(triggers.P13_CASES)
    ids = f["special_ids"]
    for case, c in f["cases"].items():
        text = triggers.P13_CASES[case]
        assert c["regex"] is None and c["structural_tag"] is None, c  # the grammar is the whole constraint
        assert c["backend"] in ("guidance", "xgrammar") and c["skip_special_tokens"] is False
        assert c["reasoning_ended"] is True                                 # binds from the first token
        want_special = [ids[t] for t in triggers.SPECIAL for _ in range(text.count(t))]
        for run in c["runs"]:
            assert run["text"] == text, run                                  # the reply is forced exactly
            assert sorted(run["special_ids_in_output"]) == sorted(want_special), run  # as special tokens
            v = run["verdict"]
            if patch13 == "on":
                assert v["kept_as_text"], run
            else:  # stock: the answer is cut at the marker
                assert not v["content_is_text"] and text.startswith(v["content"]) and len(v["content"]) < len(text)
                if case == "fenced":
                    assert v["tool_calls"] == ["get_weather"], run
