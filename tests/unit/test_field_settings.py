"""Issue 16's settings in the run spec: EFFORT_DEFAULT, MTP_BY_BATCH, MTP_BLOCK_DROP, per base."""

from __future__ import annotations

import json

import pytest

from flash_cli import profiles, recipe, spec
from flash_cli.commands import doctor
from flash_cli.output import Report
from flash_common import releases
from flash_cli.errors import ConfigError
from flash_cli.settings import BASES, resolve

SNAP = "0123456789abcdef0123456789abcdef01234567"


def settings(profile: str = "default", **overrides: str):
    p = profiles.load(profile)
    return resolve(p.layer(), {}, overrides, profile_name=p.name)


def argv(profile: str = "default", **overrides: str) -> list[str]:
    return spec.build(settings(profile, **overrides), profile=profile, snapshot=SNAP, hf_cache="/hf",
                      state_dir="/state").command


def spec_json(cmd: list[str]) -> dict:
    return json.loads(cmd[cmd.index("--speculative-config") + 1])


def test_every_base_states_the_speculative_capabilities():
    for base in BASES:
        assert isinstance(releases.has(base, "spec_tokens_per_batch_size"), bool)
        assert isinstance(releases.has(base, "spec_eagle_block_drop_flag"), bool)
    with pytest.raises(releases.ReleaseError, match="supported"):
        releases.has("v0.28", "spec_tokens_per_batch_size")


@pytest.mark.parametrize("base", BASES)
def test_effort_default_reaches_the_template_on_every_base(base):
    cmd = argv(BASE=base, EFFORT_DEFAULT="medium")
    i = cmd.index("--default-chat-template-kwargs")
    assert json.loads(cmd[i + 1]) == {"reasoning_effort": "medium"}
    assert "--default-chat-template-kwargs" not in argv(BASE=base)  # unset: the template's own default


def test_agent_profile_sets_medium_and_bad_effort_is_refused():
    assert settings("agent")["EFFORT_DEFAULT"] == "medium"
    with pytest.raises(ConfigError) as err:
        settings(EFFORT_DEFAULT="high")
    assert "EFFORT_DEFAULT='high'" in str(err.value) and "low | medium | xhigh" in err.value.hint


def test_schedule_renders_inclusive_ranges_to_seqs():
    cmd = argv("speed")
    sc = spec_json(cmd)
    assert sc["num_speculative_tokens"] == 3
    assert sc["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 5, 2], [6, 8, 1]]
    # SEQS below the last start: the last range still starts where it says (vLLM clips to max_num_seqs)
    assert spec_json(argv("speed", SEQS="4"))["num_speculative_tokens_per_batch_size"][-1] == [6, 6, 1]
    assert "num_speculative_tokens_per_batch_size" not in spec_json(argv("default"))


@pytest.mark.parametrize("value,needle", [
    ("2:1", "start at 1"),
    ("1:2,1:1", "rise strictly"),
    ("1:3,4:2,3:1", "rise strictly"),
    ("1-3", "matching"),
])
def test_bad_schedules_are_refused_naming_the_value(value, needle):
    with pytest.raises(ConfigError) as err:
        argv("speed", MTP_BY_BATCH=value)
    assert "MTP_BY_BATCH" in str(err.value) and value in str(err.value)
    assert needle in str(err.value) + (err.value.hint or "")


def test_schedule_without_mtp_is_refused():
    with pytest.raises(ConfigError, match="needs MTP > 0"):
        argv(MTP="0", MTP_BY_BATCH="1:1")


@pytest.mark.parametrize("base", BASES)
def test_block_drop_off_where_the_base_has_it_else_refused(base):
    if releases.has(base, "spec_eagle_block_drop_flag"):
        assert spec_json(argv(BASE=base, MTP_BLOCK_DROP="0"))["disable_eagle_block_drop"] is True
    else:
        with pytest.raises(ConfigError) as err:
            argv(BASE=base, MTP_BLOCK_DROP="0")
        assert f"BASE={base}" in str(err.value) and "v0.30" in err.value.hint
        # doctor reports it as a problem of the profile before any boot (serve refuses it in build())
        rep = Report(quiet=True)
        doctor.check_profile(recipe.load([f"BASE={base}", "MTP_BLOCK_DROP=0"]), rep)
        assert any("disable_eagle_block_drop" in i["text"] for i in rep.items if i["status"] == "fail")
    assert "disable_eagle_block_drop" not in spec_json(argv(BASE=base))  # vLLM's default: nothing rendered


def test_block_drop_off_without_mtp_is_refused():
    with pytest.raises(ConfigError, match="MTP_BLOCK_DROP=0 needs MTP"):
        argv(MTP="0", MTP_BLOCK_DROP="0")


def test_v029_adaptive_depth_is_accepted():
    # 0.29.0's SpeculativeConfig already has the field (read in its wheel): no refusal there
    assert spec_json(argv("v0.29", MTP="3", MTP_BY_BATCH="1:3,4:1"))["num_speculative_tokens_per_batch_size"] == [
        [1, 3, 3], [4, 8, 1]]


def test_schedule_above_mtp_is_capped_visibly():
    s = settings("speed", MTP="1")
    rs = spec.build(s, profile="speed", snapshot=SNAP, hf_cache="/hf", state_dir="/state")
    assert spec_json(rs.command)["num_speculative_tokens_per_batch_size"] == [[1, 2, 1], [3, 5, 1], [6, 8, 1]]
    assert any("caps every step at 1" in w for w in rs.warnings)
    assert not spec.build(settings("speed"), profile="speed", snapshot=SNAP, hf_cache="/hf", state_dir="/state").warnings


@pytest.mark.parametrize("base", BASES)
def test_prefix_retain_dense_renders_vllms_none_and_0_renders_nothing(base):
    """PREFIX_RETAIN (docs/PREFIX-CACHE.md): 0 leaves the release default, so the proven argv is
    unchanged; dense is `--prefix-cache-retention-interval None` (the vllm tier parses it)."""
    assert "--prefix-cache-retention-interval" not in argv(BASE=base)
    cmd = argv(BASE=base, PREFIX_RETAIN="dense")
    assert cmd[cmd.index("--prefix-cache-retention-interval") + 1] == "None"
    assert cmd.count("--prefix-cache-retention-interval") == 1


def test_prefix_retain_without_a_cache_or_with_a_number_is_refused():
    with pytest.raises(ConfigError, match=r"PREFIX_RETAIN=dense needs PREFIX_CACHE=1") as e:
        argv(PREFIX_RETAIN="dense", PREFIX_CACHE="0")
    assert "PREFIX_RETAIN=0" in e.value.hint
    with pytest.raises(ConfigError, match=r"PREFIX_RETAIN='8000'") as e:
        settings(PREFIX_RETAIN="8000")
    assert "0 | dense" in e.value.hint
