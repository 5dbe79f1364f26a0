"""Two boxes (issue 15): every box's argv per multi-node profile (golden files), the interface
others rely on (`flash serve tp2|dp2 NODES=a,b NODE_ADDRS=… --dry-run`), the RDMA options only
where they belong, the plain per-rank launch issue 17 runs, and the refusals."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from flash_cli import multinode, profiles, render
import goldens
from flash_cli.__main__ import main
from flash_cli.errors import ConfigError
from flash_cli.settings import resolve

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "serve"
SNAP = "0123456789abcdef0123456789abcdef01234567"
HF = "/home/spark/.cache/huggingface"
STATE = "/home/spark/.local/state/flash"
BOXES = {"NODES": "a,b", "NODE_ADDRS": "10.0.0.1,10.0.0.2"}
MULTI = [n for n in profiles.names() if profiles.load(n).values.get("PARALLEL", "none") != "none"]


def deployment(profile: str, **overrides: str) -> multinode.Deployment:
    p = profiles.load(profile)
    s = resolve(p.layer(), {}, {**BOXES, **overrides}, profile_name=p.name)
    return multinode.build_deployment(s, profile=p.name, snapshot=SNAP, hf_cache=HF, state_dir=STATE)


def test_the_multi_node_profiles_exist():
    assert set(MULTI) == {"tp2", "dp2", "pd"}
    default = profiles.load("default").values
    for name in MULTI:  # on top of default: its values, plus the mode and host networking
        values = profiles.load(name).values
        assert {k: values[k] for k in default} == default
        assert values["NETWORK"] == "host" and values["PARALLEL"] == name


@pytest.mark.parametrize("profile", MULTI)
@pytest.mark.parametrize("node", [0, 1])
def test_each_box_matches_golden(profile, node):
    text = render.docker_run_text(deployment(profile).nodes[node].spec) + "\n"
    path = GOLDEN / f"{profile}.node{node}.txt"
    goldens.check(path, text, f"no golden file {path.name}: FLASH_UPDATE_GOLDEN=1 pytest {__file__}",
                  f"{profile} box {node} changed; review, then FLASH_UPDATE_GOLDEN=1")


def test_pd_router_matches_golden():
    text = render.docker_run_text(deployment("pd").router.spec) + "\n"
    path = GOLDEN / "pd.router.txt"
    goldens.check(path, text, f"no golden file {path.name}: FLASH_UPDATE_GOLDEN=1 pytest {__file__}",
                  "the pd router changed; review, then FLASH_UPDATE_GOLDEN=1")


def dry_run(capsys, *words: str) -> tuple[list[list[str]], str]:
    """`flash serve … --dry-run` → each box's docker run argv (parsed back from the text)."""
    assert main(["serve", *words, "--dry-run"]) == 0
    out = capsys.readouterr().out
    boxes = [b for b in out.split("# router ")[0].split("# node ")[1:]]
    return [shlex.split(b.split("\n", 1)[1].replace("\\\n", " ")) for b in boxes], out


def after(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv.count(flag))
    return argv[argv.index(flag) + 1]


def vllm_part(argv: list[str]) -> list[str]:
    return argv[argv.index("vllm"):]


def test_interface_tp2(capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/nonexistent")
    (head, worker), _ = dry_run(capsys, "tp2", "NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2")
    h, w = vllm_part(head), vllm_part(worker)
    assert (after(h, "--nnodes"), after(h, "--node-rank"), after(h, "--master-addr")) == ("2", "0", "10.0.0.1")
    assert "--headless" not in h
    assert after(w, "--node-rank") == "1" and "--headless" in w and after(w, "--master-addr") == "10.0.0.1"
    assert after(h, "--tensor-parallel-size") == after(w, "--tensor-parallel-size") == "2"
    assert head[:2] == worker[:2] == ["docker", "run"]


def test_interface_dp2_one_endpoint(capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/nonexistent")
    (head, worker), _ = dry_run(capsys, "dp2", "NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2")
    h, w = vllm_part(head), vllm_part(worker)
    for argv in (h, w):
        assert after(argv, "--data-parallel-size") == "2" and after(argv, "--data-parallel-size-local") == "1"
        assert after(argv, "--data-parallel-address") == "10.0.0.1"
        assert after(argv, "--data-parallel-rpc-port") == "29550"
        assert "--nnodes" not in argv and "--tensor-parallel-size" not in argv
    assert "--headless" in w and after(w, "--data-parallel-start-rank") == "1"
    assert "--headless" not in h and "--data-parallel-start-rank" not in h
    dep = deployment("dp2")
    assert dep.api_urls() == ["http://127.0.0.1:18300"]  # one API endpoint: the head's
    assert "--no-healthcheck" in worker and "--health-cmd" in head


def test_pd_roles_ports_and_side_channel():
    dep = deployment("pd")
    cfgs = [json.loads(after(n.spec.command, "--kv-transfer-config")) for n in dep.nodes]
    assert cfgs == [{"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
                    {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}]
    assert [n.role for n in dep.nodes] == ["prefill", "decode"]
    # each server on its fast-link address at PD_PORT+N, where the router on box 0 reaches it
    assert [after(n.spec.command, "--port") for n in dep.nodes] == ["18310", "18311"]
    assert [after(n.spec.command, "--host") for n in dep.nodes] == ["10.0.0.1", "10.0.0.2"]
    assert [n.spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] for n in dep.nodes] == ["10.0.0.1", "10.0.0.2"]
    assert [n.spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for n in dep.nodes] == ["5600", "5601"]
    assert "NCCL_DEBUG" not in dep.nodes[0].spec.env
    assert not any("does not ship" in w for w in dep.warnings)


def test_pd_router_is_the_one_endpoint():
    dep = deployment("pd")
    r = dep.router
    assert dep.api_urls() == ["http://127.0.0.1:18300"] == [r.spec.api_url]
    assert r.spec.command == ["python3", "-m", "flash_vllm.pdrouter", "--host", "127.0.0.1", "--port", "18300",
                              "--prefill", "http://10.0.0.1:18310", "--decode", "http://10.0.0.2:18311"]
    assert r.spec.entrypoint == ["python3", "-m", "flash_vllm.launch"]  # reads the key file, as on one box
    labels = r.spec.labels
    assert (labels["org.flash.node"], labels["org.flash.role"], labels["org.flash.name"]) == ("router", "router", "qwen38-flash")
    assert labels["org.flash.settings"] == dep.head.spec.labels["org.flash.settings"]
    assert labels["org.flash.nodes"] == "a,b" and labels["org.flash.port"] == "18300"
    assert r.spec.name == "qwen38-flash-router" and not r.spec.gpus and not r.spec.devices
    assert not [m for m in r.spec.mounts if m.target == "/hf"]  # no model in the router
    assert r.engine == dep.head.engine and r.box == "a"
    assert [n.role for n in dep.containers()] == ["prefill", "decode", "router"]  # start order: router last
    # servers beyond loopback: one key for the whole deployment, the router checks it and sends it on
    assert r.spec.needs_api_key and all(n.spec.needs_api_key for n in dep.nodes)
    assert r.spec.env == {"FLASH_API_KEY_FILE": "/run/flash/api_key"}
    assert r.spec.key_file == dep.head.spec.key_file == f"{STATE}/api-key.qwen38-flash"
    assert any("needs the API key file" in w and "on that box" in w for w in dep.warnings)  # box b is remote


def test_pd_on_one_host_over_loopback_needs_no_key():
    dep = deployment("pd", NODES="localhost,localhost", NODE_ADDRS="127.0.0.1,127.0.0.1")
    assert not dep.router.spec.needs_api_key and not any(n.spec.needs_api_key for n in dep.containers())
    assert dep.router.spec.command[-4:] == ["--prefill", "http://127.0.0.1:18310", "--decode", "http://127.0.0.1:18311"]
    assert not any("key" in w for w in dep.warnings)
    off = deployment("pd", API_KEY="off")
    assert not off.router.spec.needs_api_key
    assert any("WITHOUT an API key" in w for w in off.warnings)


@pytest.mark.parametrize("pd_port", ["18300", "18299"])
def test_pd_port_clash_with_the_router_is_refused(pd_port, capsys):
    assert main(["serve", "pd", "NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2", f"PD_PORT={pd_port}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"PD_PORT={pd_port} puts a pd server on PORT=18300" in err and "PD_PORT=18310" in err


def test_pd_dry_run_prints_the_router_line(capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/nonexistent")
    _, out = dry_run(capsys, "pd", "NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2")
    router = out.split("# router ")[1]
    assert router.startswith("on a [ssh://a]") and "the deployment's one endpoint" in router.split("\n")[0]
    argv = shlex.split(router.split("\n", 1)[1].replace("\\\n", " "))
    assert argv[argv.index("flash_vllm.pdrouter") - 1:][:1] == ["-m"] and after(argv, "--decode") == "http://10.0.0.2:18311"
    assert main(["serve", "pd", "NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2", "--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["api"] == ["http://127.0.0.1:18300"] and data["router"]["spec"]["name"] == "qwen38-flash-router"


def test_rdma_only_on_multi_node_boxes_and_through_docker_py():
    from docker.api.client import APIClient
    from docker.models.containers import _create_container_args

    from flash_cli.settings import resolve as res
    from flash_cli.spec import build

    one = build(res(profiles.load("default").layer(), {}, {}), profile="default", snapshot=SNAP, hf_cache=HF,
                state_dir=STATE)
    assert not one.devices and not one.cap_add and not one.ulimits
    assert "VLLM_HOST_IP" not in one.env and "NCCL_DEBUG" not in one.env
    for node in deployment("tp2").nodes:
        kwargs = render.to_kwargs(node.spec)
        hc = _create_container_args(dict(kwargs, version="1.41"))["host_config"]
        assert hc["Devices"] == [{"PathOnHost": "/dev/infiniband", "PathInContainer": "/dev/infiniband",
                                  "CgroupPermissions": "rwm"}]
        assert hc["CapAdd"] == ["IPC_LOCK"]
        assert hc["Ulimits"] == [{"Name": "memlock", "Soft": -1, "Hard": -1}]
        assert hc["NetworkMode"] == "host"
    off = deployment("tp2", RDMA="0")
    assert not any(n.spec.devices or n.spec.cap_add or n.spec.ulimits for n in off.nodes)
    assert any("RDMA=0" in w for w in off.warnings)
    APIClient  # imported for parity with test_runspec (the translation needs no daemon)


def test_headless_worker_has_no_key_no_health_and_own_name():
    dep = deployment("tp2", BIND="10.0.0.1")  # exposed: the head needs a key, the worker serves nothing
    head, worker = dep.nodes
    assert head.spec.needs_api_key and "FLASH_API_KEY_FILE" in head.spec.env
    assert not worker.spec.needs_api_key and "FLASH_API_KEY_FILE" not in worker.spec.env
    assert not [m for m in worker.spec.mounts if "api-key" in m.source]
    assert worker.spec.healthcheck == {"test": ["NONE"]}
    assert (head.spec.name, worker.spec.name) == ("qwen38-flash", "qwen38-flash-node1")
    assert head.spec.labels["org.flash.name"] == worker.spec.labels["org.flash.name"] == "qwen38-flash"
    assert [n.spec.labels["org.flash.node"] for n in dep.nodes] == ["0", "1"]
    assert head.spec.labels["org.flash.settings"] == worker.spec.labels["org.flash.settings"]
    assert [n.spec.env["VLLM_HOST_IP"] for n in dep.nodes] == ["10.0.0.1", "10.0.0.2"]


def test_plain_launch_for_one_host_two_gpus():
    """Issue 17: each rank's `vllm serve` argv + env without Docker, GPUs picked per rank."""
    dep = deployment("tp2", NODES="localhost,localhost", NODE_ADDRS="127.0.0.1,127.0.0.1", NODE_GPUS="0,1")
    plains = [n.plain(HF) for n in dep.nodes]
    assert [p["env"]["CUDA_VISIBLE_DEVICES"] for p in plains] == ["0", "1"]
    assert plains[0]["argv"][:2] == ["vllm", "serve"] and plains[0]["argv"][2].startswith(HF + "/hub/")
    assert plains[0]["env"]["HF_HOME"] == HF
    assert after(plains[1]["argv"], "--master-addr") == "127.0.0.1" and "--headless" in plains[1]["argv"]
    assert [n.engine for n in dep.nodes] == ["", ""]
    assert [n.spec.gpu_ids for n in dep.nodes] == [["0"], ["1"]]
    hc = render.to_kwargs(dep.nodes[1].spec)["device_requests"][0]
    assert hc["DeviceIDs"] == ["1"]
    assert '"device=1"' in render.to_docker_run(dep.nodes[1].spec)


def test_dry_run_json_exposes_per_node_plain_launch(capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/nonexistent")
    assert main(["serve", "dp2", "NODES=localhost,localhost", "NODE_ADDRS=127.0.0.1,127.0.0.1", "NODE_GPUS=0,1",
                 "--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parallel"] == "dp2" and data["api"] == ["http://127.0.0.1:18300"]
    assert [n["plain"]["env"]["CUDA_VISIBLE_DEVICES"] for n in data["nodes"]] == ["0", "1"]
    assert [n["role"] for n in data["nodes"]] == ["head", "worker"]


@pytest.mark.parametrize("words,needle", [
    (["NODES=a"], "needs 2 boxes in NODES"),
    (["NODES=a,b,c", "NODE_ADDRS=10.0.0.1,10.0.0.2"], "got 3"),
    (["NODES=a,b"], "NODE_ADDRS"),
    (["NODES=a,b", "NODE_ADDRS=10.0.0.1,a"], "'a' is not an IP address"),
    (["NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2", "NETWORK=bridge"], "needs NETWORK=host"),
    (["NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2", "NODE_GPUS=0"], "NODE_GPUS has 1 entries"),
    (["NODES=ftp://a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2"], "unknown scheme 'ftp'"),
    (["NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2", "PARALLEL=tp3"], "PARALLEL='tp3'"),
])
def test_bad_boxes_are_refused_with_the_value(words, needle, capsys):
    assert main(["serve", "tp2", *words, "--dry-run"]) == 2
    assert needle in capsys.readouterr().err


def test_engine_urls():
    assert multinode.engine_url("localhost") == ""
    assert multinode.engine_url("spark2") == "ssh://spark2"
    assert multinode.engine_url("me@spark2") == "ssh://me@spark2"
    assert multinode.engine_url("unix:///tmp/d.sock") == "unix:///tmp/d.sock"
    with pytest.raises(ConfigError):
        multinode.engine_url("ftp://x")


# -- flash plan for two boxes -----------------------------------------------------------------
def test_plan_dp2_is_two_one_box_pools_and_tp2_splits_the_weights():
    from flash_cli.plan import build as plan_build, hardware, parallel

    p = profiles.load("tp2")
    s = resolve(p.layer(), {}, BOXES, profile_name=p.name)
    single = plan_build(s, hardware.preset("gb10"), snapshot=None)
    dp = parallel.plan(single, "dp2")
    assert dp["pools"] == 2 and dp["aggregate"]["kv_cache_tokens"] == 2 * single["kv_cache_tokens"]
    assert [r["kv_cache_tokens"] for r in dp["ranks"]] == [single["kv_cache_tokens"]] * 2
    tp = parallel.plan(single, "tp2")
    assert tp["pools"] == 1
    assert tp["ranks"][0]["weights_gib"] == pytest.approx(single["weights_gib"] / 2, abs=1e-3)
    b = single["budget"]
    freed = single["weights_gib"] / 2
    assert tp["ranks"][0]["kv_cache_gib"] == pytest.approx(b["kv_cache_gib"] + freed, abs=1e-2)
    # a token costs each rank half: the pool is (2 × per-rank KV) worth of one-box tokens
    want = 2 * tp["ranks"][0]["kv_cache_gib"] / b["kv_cache_gib"] * single["kv_cache_tokens"]
    assert tp["aggregate"]["kv_cache_tokens"] == pytest.approx(want, rel=1e-3)
    assert any("first-order" in line for line in parallel.render(tp))


def test_plan_command_reports_the_deployment(capsys):
    assert main(["plan", "dp2", "--hardware", "gb10", "--no-snapshot", "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["parallel"]["mode"] == "dp2" and data["parallel"]["pools"] == 2


# -- doctor's judgement of the boxes' facts (nodecheck.judge is pure) -----------------------------
def box_facts(i: int, **over) -> dict:
    f = {"node": i, "box": "ab"[i], "engine": f"ssh://{'ab'[i]}", "kernel": "6.11.0-1016-nvidia", "clock_offset_s": 0.02,
         "clock_rtt_s": 0.01, "user": "spark", "image_id": "sha256:" + "1" * 64, "rdma_options_accepted": True,
         "probe": {"memlock_unlimited": True, "ipc_lock": True, "infiniband": ["rdma_cm", "uverbs0"],
                   "ib_ports": [{"dev": "rocep1s0f1", "port": "1", "state": "4: ACTIVE", "rate": "200 Gb/sec (2X NDR)"}],
                   "revision": "abc", "snapshot": True, "variant": True, "variant_marker": {"format": 2},
                   "lingering": ["spark"], "remove_ipc": None, "key_file": None},
         "nccl": "ib"}
    for k, v in over.items():
        if k in f["probe"]:
            f["probe"] = {**f["probe"], k: v}
        else:
            f[k] = v
    return f


def judged(*facts, **settings):
    from flash_cli import nodecheck

    p = profiles.load("tp2")
    s = resolve(p.layer(), {}, {**BOXES, **settings}, profile_name=p.name)
    return nodecheck.judge(list(facts), s)


def fails(found) -> list[str]:
    return [t for level, t in found if level == "fail"]


def test_doctor_all_good():
    found = judged(box_facts(0), box_facts(1))
    assert not fails(found), fails(found)
    assert not [t for level, t in found if level == "warn"]
    assert any("same image on every box" in t for _, t in found)


@pytest.mark.parametrize("box,over,needle", [
    (1, {"image_id": "sha256:" + "2" * 64}, "different images"),
    (1, {"revision": "def"}, "different checkpoint revisions"),
    (0, {"kernel": "7.0.0-1019-nvidia"}, "is known bad: ibv_reg_mr"),
    (1, {"clock_offset_s": 2.5}, "clock +2.50 s off"),
    (1, {"memlock_unlimited": False}, "NOT memlock unlimited"),
    (1, {"ipc_lock": False}, "NOT IPC_LOCK"),
    (0, {"infiniband": None}, "NOT /dev/infiniband"),
    (0, {"rdma_options_accepted": False, "rdma_error": "no such device"}, "RDMA options do not start"),
    (1, {"ib_ports": [{"state": "4: ACTIVE", "rate": "100 Gb/sec (2X HDR)"}]}, "link at 100 Gb/s, expected 200"),
    (1, {"ib_ports": [{"state": "1: DOWN", "rate": "200 Gb/sec"}]}, "no active RDMA port"),
    (1, {"nccl": "socket"}, "NCCL fell back to sockets"),
    (0, {"snapshot": False}, "not in HF_CACHE"),
    (1, {"variant": False}, "variant is not prepared"),
    (1, {"variant_marker": {"format": 1}}, "prepared variants differ"),
    (1, {"image_id": None}, "is not there"),
    (1, {"unreachable": "box 1 (b) is unreachable"}, "unreachable"),
    (1, {"key_file": False, "key_path": "/home/spark/.local/state/flash/api-key.qwen38-flash"},
     "API key file /home/spark/.local/state/flash/api-key.qwen38-flash is not there"),
])
def test_doctor_catches(box, over, needle):
    facts = [box_facts(0), box_facts(1)]
    facts[box] = box_facts(box, **over)
    found = fails(judged(*facts))
    assert any(needle in t for t in found), found


def test_doctor_lingering_warns_and_dp2_sockets_only_warn():
    found = judged(box_facts(0), box_facts(1, lingering=[]))
    assert any("sudo loginctl enable-linger spark" in t for level, t in found if level == "warn")
    assert not fails(judged(box_facts(0, user="root", lingering=[]), box_facts(1, remove_ipc="no", lingering=[])))
    found = judged(box_facts(0, nccl="socket"), box_facts(1), PARALLEL="dp2")
    assert not fails(found) and any("NCCL over sockets" in t for _, t in found)


def test_known_bad_kernels_are_data():
    from flash_cli import nodecheck

    assert nodecheck.bad_kernel("7.0.0-1019-nvidia-64k")["prefix"] == "7.0.0-1019"
    assert nodecheck.bad_kernel("6.11.0-1016-nvidia") is None
    assert nodecheck._utc("2026-12-01T15:20:01.5Z") == pytest.approx(1796138401.5)
