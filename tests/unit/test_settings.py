import pytest

from flash_cli import profiles
from flash_cli.errors import ConfigError
from flash_cli.settings import BY_NAME, SETTINGS, resolve, split_args


def test_precedence_defaults_profile_env_args():
    s = resolve({"MTP": "3", "CTX": "500000"}, {"MTP": "4", "PORT": "18400"}, {"MTP": "5"}, profile_name="p")
    assert s["MTP"] == 5 and s.source["MTP"] == "arg"
    assert s["PORT"] == 18400 and s.source["PORT"] == "env"
    assert s["CTX"] == 500000 and s.source["CTX"] == "profile:p"
    assert s["SEQS"] == BY_NAME["SEQS"].default and s.source["SEQS"] == "default"


def test_env_ignores_foreign_keys_and_empty_values():
    s = resolve({"MTP": "3"}, {"CC": "gcc", "MTP": "", "PATH": "/bin"})
    assert s["MTP"] == 3  # an exported empty variable does not mask the profile


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError) as err:
        resolve(overrides={"MTPP": "3"})
    assert "MTPP" in str(err.value) and "MTP" in err.value.hint and err.value.exit_code == 2


@pytest.mark.parametrize("key,raw,needle", [
    ("MODE", "fp4", "nvfp4 | hybrid | hybrid-mtp"),
    ("GPU_MEM", "1.5", "[0.05, 0.95]"),
    ("PORT", "http", "an integer"),
    ("YARN", "maybe", "0 or 1"),
    ("BIND", "localhost:80", "IP address"),
    ("KV_CACHE_MEM", "lots", "16G"),
    ("DET_TOPK", "yes", "0 | 1 | radix | repair"),  # a mode now, no longer a bool
])
def test_bad_values_name_key_and_accepted(key, raw, needle):
    with pytest.raises(ConfigError) as err:
        resolve(overrides={key: raw})
    assert key in str(err.value) and raw in str(err.value)
    assert needle in err.value.hint


def test_sizes_and_bools():
    s = resolve(overrides={"KV_CACHE_MEM": "16G", "YARN": "yes", "SHM_SIZE": "512m"})
    assert s["KV_CACHE_MEM"] == 16 * 1024**3 and s["YARN"] is True and s["SHM_SIZE"] == 512 * 1024**2
    assert resolve(overrides={"KV_CACHE_MEM": ""})["KV_CACHE_MEM"] is None


def test_det_topk_modes_reach_patch_8_verbatim():
    assert resolve()["DET_TOPK"] == "repair" and resolve().as_env()["DET_TOPK"] == "repair"  # the default since run44
    for mode in ("0", "1", "radix", "repair"):
        s = resolve(overrides={"DET_TOPK": mode})
        assert s["DET_TOPK"] == mode and BY_NAME["DET_TOPK"].env == "VLLM_QSA_DET_TOPK"


def test_extra_split_once_with_quotes():
    assert split_args("--a 'b c' --d=\"e f\"", "EXTRA") == ["--a", "b c", "--d=e f"]
    with pytest.raises(ConfigError):
        split_args("--a 'unbalanced", "EXTRA")


def test_every_setting_default_is_valid():
    for s in SETTINGS:
        assert s.parse(s.format(s.default)) == s.default, s.name


def test_all_profiles_load_and_resolve():
    names = profiles.names()
    assert names[0] == "default"
    assert set(names) >= {"default", "speed", "context", "context-1m", "shared", "published", "native", "v0.29"}
    for n in names:
        p = profiles.load(n)
        assert p.desc, n
        resolve(p.layer(), {}, profile_name=n)
    assert resolve(profiles.load("v0.29").layer())["BASE"] == "v0.29"
    shared = resolve(profiles.load("shared").layer())
    assert shared["LONG_PREFILL"] == 800 and shared["EXTRA"] is None  # a typed setting, not a flag in EXTRA


def test_profile_typo_is_rejected(tmp_path):
    (tmp_path / "bad.env").write_text("# desc: x\nMTPP=3\n")
    with pytest.raises(ConfigError) as err:
        profiles.load("bad", tmp_path)
    assert "bad.env:2" in str(err.value) and "MTP" in err.value.hint


def test_settings_reference_is_generated_from_the_table():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "tools" / "gen_settings_doc.py"), "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = (root / "docs" / "SETTINGS.md").read_text()
    for s in SETTINGS:
        assert f"| `{s.name}` |" in text
