"""Run specs: every profile against its golden file, plus the rules the spec must keep."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import goldens
from flash_cli import profiles, render, spec
from flash_cli.settings import resolve
from flash_common import releases

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "serve"
SNAP = "0123456789abcdef0123456789abcdef01234567"
HF = "/home/spark/.cache/huggingface"
STATE = "/home/spark/.local/state/flash"


def spec_for(profile: str, **overrides: str) -> spec.RunSpec:
    p = profiles.load(profile)
    s = resolve(p.layer(), {}, overrides, profile_name=p.name)
    return spec.build(s, profile=p.name, snapshot=SNAP, hf_cache=HF, state_dir=STATE)


def single_box(name: str) -> bool:
    return profiles.load(name).values.get("PARALLEL", "none") == "none"


@pytest.mark.parametrize("profile", [n for n in profiles.names() if single_box(n)])
def test_profile_matches_golden(profile):
    text = render.docker_run_text(spec_for(profile)) + "\n"
    path = GOLDEN / f"{profile}.txt"
    goldens.check(path, text, f"no golden file for {profile}: FLASH_UPDATE_GOLDEN=1 pytest {__file__}",
                  f"run spec of {profile} changed; review, then FLASH_UPDATE_GOLDEN=1")


def test_every_profile_has_a_golden_file_and_no_orphans():
    """One file per single-box profile, one per box for the multi-node ones and one for the router
    of a pd layout (test_multinode.py)."""
    from flash_cli import layout

    multi = {n: layout.parse(profiles.load(n).values["PARALLEL"]) for n in profiles.names() if not single_box(n)}
    want = {n for n in profiles.names() if single_box(n)}
    want |= {f"{n}.node{i}" for n, lay in multi.items() for i in range(lay.boxes)}
    want |= {f"{n}.router" for n, lay in multi.items() if lay.kind == "pd"}
    assert {p.stem for p in GOLDEN.glob("*.txt")} == want


def test_text_is_exactly_the_argv():
    r = spec_for("shared", EXTRA="--foo 'a b' --bar=\"c d\"")
    assert shlex.split(render.docker_run_text(r).replace("\\\n", " ")) == render.to_docker_run(r)
    assert r.command[-3:] == ["--foo", "a b", "--bar=c d"]  # EXTRA split once, kept last


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_yarn_mtp_and_draft_length():
    r = spec_for("default")
    overrides = json.loads(arg(r.command, "--hf-overrides"))
    rope = overrides["text_config"]["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 262144
    spec_cfg = json.loads(arg(r.command, "--speculative-config"))
    assert spec_cfg == {"method": "mtp", "num_speculative_tokens": 2, "max_model_len": 500000}
    assert r.env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"
    native = spec_for("native")
    assert "--hf-overrides" not in native.command
    assert "max_model_len" not in json.loads(arg(native.command, "--speculative-config"))
    assert "--speculative-config" not in spec_for("default", MTP="0").command
    assert "VLLM_MTP_DRAFT_VOCAB" not in spec_for("default", MTP="0").env


def test_modes_paths_and_env():
    assert arg(spec_for("published").command, "serve").endswith(f"/snapshots/{SNAP}")
    assert "VLLM_FP8_HYBRID" not in spec_for("published").env
    hyb = spec_for("default")
    assert arg(hyb.command, "serve").endswith(f"{SNAP}-fp8hybrid") and hyb.env["VLLM_FP8_HYBRID"] == "1"
    ctx = spec_for("context")
    assert arg(ctx.command, "serve") == f"/hf/hub/models--RadixArk--Qwen3.8-Flash-Next-NVFP4/snapshots/{SNAP}-fp8hybrid-mtpnvfp4"


def test_effort_alias_per_base():
    assert "--reasoning-effort-map" in spec_for("default").command
    old = spec_for("v0.29")
    assert "--reasoning-effort-map" not in old.command and old.env["FLASH_EFFORT_ALIAS"] == "1"
    assert "FLASH_EFFORT_ALIAS" not in spec_for("v0.29", EFFORT_ALIAS="0").env


def test_secure_by_default():
    r = spec_for("default")
    assert r.ports == {"8000/tcp": ("127.0.0.1", 18300)} and not r.needs_api_key
    exposed = spec_for("default", BIND="0.0.0.0")
    assert exposed.needs_api_key and exposed.env["FLASH_API_KEY_FILE"] == spec.KEY_TARGET
    assert any(m.target == spec.KEY_TARGET and m.read_only for m in exposed.mounts)
    everything = " ".join(render.to_docker_run(exposed))
    assert "sk-flash" not in everything and "VLLM_API_KEY" not in everything
    loud = spec_for("default", BIND="0.0.0.0", API_KEY="off")
    assert not loud.needs_api_key and any("WITHOUT an API key" in w for w in loud.warnings)


def test_labels_find_and_describe_the_container():
    r = spec_for("speed", PORT="18301")
    assert r.labels["org.flash.name"] == "qwen38-flash" and r.labels["org.flash.profile"] == "speed"
    assert r.labels["org.flash.port"] == "18301" and r.labels["org.flash.base"] == releases.CURRENT
    assert r.labels["org.flash.settings"] != spec_for("speed").labels["org.flash.settings"]


def test_host_network_listens_on_bind_port():
    r = spec_for("default", NETWORK="host", PORT="18555")
    assert r.ports == {} and arg(r.command, "--host") == "127.0.0.1" and arg(r.command, "--port") == "18555"
    assert "--network" in render.to_docker_run(r)


def test_compile_cache_volume_or_bind_or_none():
    vols = [m for m in spec_for("default").mounts if m.kind == "volume"]
    assert {m.source for m in vols} == {"flash-compile-vllm", "flash-compile-flashinfer", "flash-compile-triton"}
    binds = [m for m in spec_for("default", COMPILE_CACHE="/data/cc").mounts if m.target.startswith("/root/")]
    assert {m.source for m in binds} == {"/data/cc/vllm", "/data/cc/flashinfer", "/data/cc/triton"}
    assert not [m for m in spec_for("default", COMPILE_CACHE="").mounts if m.target.startswith("/root/")]


def test_docker_py_translation_accepts_every_kwarg():
    """Push the kwargs through docker-py's real create_container translation (no daemon)."""
    from docker.api.client import APIClient
    from docker.models.containers import RUN_CREATE_KWARGS, RUN_HOST_CONFIG_KWARGS, _create_container_args

    r = spec_for("default", BIND="0.0.0.0", PROM_MULTIPROC="1", CPUSET="5-9", LOG_REQUESTS="1")
    kwargs = render.to_kwargs(r)
    unknown = set(kwargs) - set(RUN_CREATE_KWARGS) - set(RUN_HOST_CONFIG_KWARGS) - {"detach", "image", "command", "ports"}
    assert not unknown
    api = APIClient(base_url="tcp://127.0.0.1:1", version="1.41")
    create = _create_container_args(dict(kwargs, version="1.41"))
    hc = create.pop("host_config")
    assert create.pop("name") == "qwen38-flash"
    config = api.create_container_config(**create)
    assert config["Entrypoint"] == ["python3", "-m", "flash_vllm.launch"]
    assert config["Cmd"][:2] == ["vllm", "serve"]
    assert hc["PortBindings"] == {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "18300"}]}
    assert hc["IpcMode"] == "host" and hc["ShmSize"] == 16 * 1024**3 and hc["CpusetCpus"] == "5-9"
    assert hc["DeviceRequests"][0]["Count"] == -1 and hc["RestartPolicy"]["Name"] == "unless-stopped"
    assert hc["LogConfig"]["Config"] == {"max-size": "100m", "max-file": "3"}
    assert {m["Target"]: m["Type"] for m in hc["Mounts"]}["/tmp/vllm-prometheus"] == "tmpfs"


def test_container_env_passthrough_and_secret_refusal():
    from flash_cli.errors import ConfigError

    r = spec_for("default", CONTAINER_ENV="NCCL_DEBUG=INFO FOO='a b'")
    assert r.env["NCCL_DEBUG"] == "INFO" and r.env["FOO"] == "a b"
    for bad in ("VLLM_API_KEY=x", "notakv", "1BAD=x"):
        with pytest.raises(ConfigError):
            spec_for("default", CONTAINER_ENV=bad)


def test_effort_map_is_the_plugins():
    from flash_vllm.patches.p12_effort_alias import EFFORT_MAP

    assert spec.EFFORT_MAP is EFFORT_MAP  # the run spec's --reasoning-effort-map and patch 12: one map
