"""2 to 4 boxes (issues 15, 35): every box's argv per multi-node profile (golden files), the
interface others rely on (`flash serve tp2|dp2 NODES=a,b NODE_ADDRS=… --dry-run`), every layout
rendered for 2, 3 and 4 boxes, the RDMA options only where they belong, the plain per-rank launch
issue 17 runs, and the refusals (head counts, box counts)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from flash_cli import engine, layout, multinode, profiles, render
import goldens
from flash_cli.__main__ import main
from flash_cli.errors import ConfigError
from flash_cli.settings import resolve

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "serve"
SNAP = "0123456789abcdef0123456789abcdef01234567"
HF = "/home/spark/.cache/huggingface"
STATE = "/home/spark/.local/state/flash"
MULTI = [n for n in profiles.names() if profiles.load(n).values.get("PARALLEL", "none") != "none"]


def boxes_for(n: int) -> dict[str, str]:
    return {"NODES": ",".join("abcd"[:n]), "NODE_ADDRS": ",".join(f"10.0.0.{i + 1}" for i in range(n))}


def deployment(profile: str, **overrides: str) -> multinode.Deployment:
    p = profiles.load(profile)
    n = layout.parse(overrides.get("PARALLEL") or p.values["PARALLEL"]).boxes
    s = resolve(p.layer(), {}, {**boxes_for(n), **overrides}, profile_name=p.name)
    return multinode.build_deployment(s, profile=p.name, snapshot=SNAP, hf_cache=HF, state_dir=STATE)


def test_the_multi_node_profiles_exist():
    assert set(MULTI) == {"tp2", "dp2", "pd", "tp4ep", "pd3", "nvidia-tp2"}
    default = profiles.load("default").values
    for name in set(MULTI) - {"nvidia-tp2"}:  # on top of default: its values, plus the mode and host networking
        values = profiles.load(name).values
        assert {k: values[k] for k in default} == default
        assert values["NETWORK"] == "host" and values["PARALLEL"] == name


@pytest.mark.parametrize("profile,node", [(p, i) for p in MULTI
                                          for i in range(layout.parse(profiles.load(p).values["PARALLEL"]).boxes)])
def test_each_box_matches_golden(profile, node):
    text = render.docker_run_text(deployment(profile).nodes[node].spec) + "\n"
    path = GOLDEN / f"{profile}.node{node}.txt"
    goldens.check(path, text, f"no golden file {path.name}: FLASH_UPDATE_GOLDEN=1 pytest {__file__}",
                  f"{profile} box {node} changed; review, then FLASH_UPDATE_GOLDEN=1")


@pytest.mark.parametrize("profile", ["pd", "pd3"])
def test_pd_router_matches_golden(profile):
    text = render.docker_run_text(deployment(profile).router.spec) + "\n"
    path = GOLDEN / f"{profile}.router.txt"
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
                              "--workers", "0", "--prefill", "http://10.0.0.1:18310", "--decode", "http://10.0.0.2:18311"]
    # ROUTER_WORKERS reaches the router's argv (0: the router picks min(4, its cores))
    assert deployment("pd", ROUTER_WORKERS="3").router.spec.command[7:9] == ["--workers", "3"]
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
    (["NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2", "PARALLEL=tp3"], "PARALLEL=tp3: vLLM refuses tensor parallel size 3"),
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


# -- flash plan for 2 to 4 boxes ------------------------------------------------------------
def one_box_and_rank(parallel: str, **over: str):
    from flash_cli.plan import build as plan_build, hardware

    lay = layout.parse(parallel)
    p = profiles.load("tp2")
    s = resolve(p.layer(), {}, {**boxes_for(lay.boxes), "PARALLEL": parallel, **over}, profile_name=p.name)
    hw = hardware.preset("gb10")
    single = plan_build(s, hw, snapshot=None)
    rank = plan_build(s, hw, snapshot=None, split=(lay.tp, lay.pp)) if lay.rendezvous else None
    return lay, single, rank


def test_plan_dp_and_pd_boxes_are_one_box_plans():
    from flash_cli.plan import parallel

    for name, pools, decode_pools in (("dp2", 2, 2), ("dp3", 3, 3), ("dp4", 4, 4), ("pd", 2, 1), ("pd4", 4, 3)):
        lay, single, _ = one_box_and_rank(name)
        dp = parallel.plan(single, lay)
        assert dp["pools"] == pools and dp["boxes"] == lay.boxes == len(dp["ranks"])
        assert dp["aggregate"]["kv_cache_tokens"] == decode_pools * single["kv_cache_tokens"], name
        assert [r["kv_cache_tokens"] for r in dp["ranks"]] == [single["kv_cache_tokens"]] * lay.boxes
        assert [r["weights_gib"] for r in dp["ranks"]] == [single["weights_gib"]] * lay.boxes
    assert [r["role"] for r in parallel.plan(single, "pd4")["ranks"]] == ["prefill", "decode", "decode", "decode"]


@pytest.mark.parametrize("name", ["tp2", "tp4", "tp4ep", "pp2", "pp3", "pp4", "tp2pp2"])
def test_plan_each_rank_holds_its_share(name):
    from flash_cli.plan import parallel

    lay, single, rank = one_box_and_rank(name)
    p = parallel.plan(single, lay, rank)
    n = lay.boxes
    assert p["pools"] == 1 and len(p["ranks"]) == n
    assert p["ranks"][0]["weights_gib"] == pytest.approx(single["weights_gib"] / n, abs=1e-3)
    # the budget per box is the same; what the weights freed goes to KV
    b, rb = single["budget"], rank["budget"]
    assert rb["requested_gib"] == b["requested_gib"]
    assert rb["kv_cache_gib"] > b["kv_cache_gib"] + 0.9 * (single["weights_gib"] - rank["budget"]["weights_gib"])
    assert p["aggregate"]["kv_cache_tokens"] == rank["kv_cache_tokens"] > single["kv_cache_tokens"]
    assert all(r["page_cache_for_ple_gib"] == rank["host"]["page_cache_for_ple_gib"] for r in p["ranks"])
    assert any("first-order" in line for line in parallel.render(p))
    with pytest.raises(ValueError, match="per-rank plan"):
        parallel.plan(single, lay)


def test_plan_tp4_keeps_a_replicated_kv_head_per_rank():
    """At tp4 the 2 QSA KV heads cannot split four ways: each rank keeps one (as at tp2), so a token
    costs a tp4 rank about what it costs a tp2 rank, not half of it; the GDN state still splits by 4."""
    from flash_cli.geometry import REAL, per_rank

    assert (per_rank(REAL, 2).num_key_value_heads, per_rank(REAL, 4).num_key_value_heads) == (1, 1)
    assert per_rank(REAL, 4).gdn_conv_dim * 4 == REAL.gdn_conv_dim
    assert per_rank(REAL, 1, 3).qsa_layers == REAL.qsa_layers // 3
    _, single, tp2 = one_box_and_rank("tp2")
    _, _, tp4 = one_box_and_rank("tp4")
    share2 = tp2["kv_bytes_per_token"] / single["kv_bytes_per_token"]
    share4 = tp4["kv_bytes_per_token"] / single["kv_bytes_per_token"]
    assert 0.4 < share2 < 0.6 and share4 > 0.4  # not 0.25: replicated KV heads
    assert share4 == pytest.approx(share2, rel=0.1)
    assert any("1 of 2 QSA KV heads" in a for a in tp4["assumptions"])
    from flash_cli.plan import parallel

    assert "replicated" in parallel.plan(single, "tp4", tp4)["note"]


def test_plan_command_reports_the_deployment(capsys):
    assert main(["plan", "dp2", "--hardware", "gb10", "--no-snapshot", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parallel"]["mode"] == "dp2" and data["parallel"]["pools"] == 2


# -- doctor's judgement of the boxes' facts (nodecheck.judge is pure) -----------------------------
def box_facts(i: int, **over) -> dict:
    f = {"node": i, "box": "abcd"[i], "engine": f"ssh://{'abcd'[i]}", "kernel": "6.11.0-1016-nvidia", "clock_offset_s": 0.02,
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
    n = len(facts)
    s = resolve(p.layer(), {}, {**boxes_for(n), **({"PARALLEL": "tp4ep"} if n == 4 else {}), **settings},
                profile_name=p.name)
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
    assert engine.epoch("2026-12-01T15:20:01.5Z") == pytest.approx(1796138401.5)


# -- 3 and 4 boxes (issue 35) -------------------------------------------------------------------
def test_the_accepted_layouts_follow_the_head_counts():
    from flash_cli.geometry import REAL

    assert layout.ACCEPTED == ("tp2", "tp2ep", "tp4", "tp4ep", "tp2pp2", "pp2", "pp3", "pp4", "dp2", "dp3", "dp4",
                               "pd", "pd3", "pd4")
    assert layout.tp_problems(2) == layout.tp_problems(4) == []
    why = layout.tp_problems(3)
    assert any("replicated QSA KV heads" in w for w in why) and any("16 GDN key heads" in w for w in why)
    assert any("GDN conv dimension 10,240" in w for w in why)
    # a geometry with 3 KV heads and 48 of everything else would allow tp3: the rules read the numbers
    from dataclasses import replace

    g3 = replace(REAL, num_key_value_heads=3, linear_num_key_heads=48)
    assert layout.tp_problems(3, g3) == [] and "tp3" in layout.accepted(g3)
    from flash_cli.settings import BY_NAME

    assert BY_NAME["PARALLEL"].choices == ("none", *layout.ACCEPTED)


def tail(argv: list[str], flag: str) -> list[str]:
    return argv[argv.index(flag):]


# Written out by hand from vLLM's multi-node docs (not from rank_args' formula): box 2's flags.
LITERAL_BOX2 = {
    "tp2pp2": ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--nnodes", "4", "--node-rank", "2",
               "--master-addr", "10.0.0.1", "--master-port", "29501", "--headless"],
    "pp3": ["--pipeline-parallel-size", "3", "--nnodes", "3", "--node-rank", "2", "--master-addr", "10.0.0.1",
            "--master-port", "29501", "--headless"],
    "tp4ep": ["--tensor-parallel-size", "4", "--enable-expert-parallel", "--nnodes", "4", "--node-rank", "2",
              "--master-addr", "10.0.0.1", "--master-port", "29501", "--headless"],
    "dp3": ["--data-parallel-size", "3", "--data-parallel-size-local", "1", "--data-parallel-address", "10.0.0.1",
            "--data-parallel-rpc-port", "29550", "--data-parallel-start-rank", "2", "--headless"],
}


@pytest.mark.parametrize("name", sorted(LITERAL_BOX2))
def test_box_two_of_a_layout_gets_the_flags_written_out(name):
    box2 = deployment("tp2", PARALLEL=name).nodes[2].spec.command
    want = LITERAL_BOX2[name]
    assert tail(box2, want[0]) == want, box2

@pytest.mark.parametrize("name", layout.ACCEPTED)
def test_every_layout_renders_each_of_its_boxes(name):
    lay = layout.parse(name)
    dep = deployment("tp2", PARALLEL=name)
    n = lay.boxes
    addrs = [f"10.0.0.{i + 1}" for i in range(n)]
    assert len(dep.nodes) == n and [x.addr for x in dep.nodes] == addrs
    assert [x.spec.name for x in dep.nodes] == ["qwen38-flash"] + [f"qwen38-flash-node{i}" for i in range(1, n)]
    assert [x.spec.labels["org.flash.node"] for x in dep.nodes] == [str(i) for i in range(n)]
    assert {x.spec.labels["org.flash.parallel"] for x in dep.nodes} == {name}
    assert [x.role for x in dep.nodes] == lay.roles()
    assert [x.spec.env["VLLM_HOST_IP"] for x in dep.nodes] == addrs
    for x in dep.nodes:
        argv, i = x.spec.command, x.index
        if lay.rendezvous:
            want = (["--tensor-parallel-size", str(lay.tp)] if lay.tp > 1 else []) \
                + (["--pipeline-parallel-size", str(lay.pp)] if lay.pp > 1 else []) \
                + (["--enable-expert-parallel"] if lay.ep else []) \
                + ["--nnodes", str(n), "--node-rank", str(i), "--master-addr", "10.0.0.1", "--master-port", "29501"] \
                + (["--headless"] if i else [])
            first = "--tensor-parallel-size" if lay.tp > 1 else "--pipeline-parallel-size"
            assert tail(argv, first) == want, argv
            assert x.serves_api is (i == 0) and x.spec.env["NCCL_DEBUG"] == "INFO"
        elif lay.kind == "dp":
            want = ["--data-parallel-size", str(n), "--data-parallel-size-local", "1", "--data-parallel-address",
                    "10.0.0.1", "--data-parallel-rpc-port", "29550"] \
                + (["--data-parallel-start-rank", str(i), "--headless"] if i else [])
            assert tail(argv, "--data-parallel-size") == want, argv
            assert "--nnodes" not in argv
        else:
            assert json.loads(after(argv, "--kv-transfer-config"))["kv_role"] == ("kv_consumer" if i else "kv_producer")
            assert (after(argv, "--host"), after(argv, "--port")) == (addrs[i], str(18310 + i))
            assert x.spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(5600 + i)
            assert "--headless" not in argv and x.serves_api
    if lay.kind == "pd":
        decodes = [f"http://{a}:{18310 + i}" for i, a in enumerate(addrs)][1:]
        assert dep.router.spec.command[-2 * (n - 1):] == [w for u in decodes for w in ("--decode", u)]
        assert dep.router.spec.command.count("--prefill") == 1
    else:
        assert dep.router is None and dep.api_urls() == ["http://127.0.0.1:18300"]  # one endpoint: the head's


def test_tp4ep_is_the_4_spark_anchor_layout():
    dep = deployment("tp4ep")
    assert tail(dep.nodes[0].spec.command, "--tensor-parallel-size") == [
        "--tensor-parallel-size", "4", "--enable-expert-parallel", "--nnodes", "4", "--node-rank", "0",
        "--master-addr", "10.0.0.1", "--master-port", "29501"]
    assert tail(dep.nodes[3].spec.command, "--node-rank")[:2] == ["--node-rank", "3"]
    assert dep.nodes[3].spec.command[-1] == "--headless" and dep.nodes[3].spec.healthcheck == {"test": ["NONE"]}
    assert [x.engine for x in dep.nodes] == ["ssh://a", "ssh://b", "ssh://c", "ssh://d"]


def test_pd3_router_spreads_over_both_decode_servers_and_names_the_key_copies():
    dep = deployment("pd3")
    assert dep.router.spec.command[-6:] == ["--prefill", "http://10.0.0.1:18310", "--decode", "http://10.0.0.2:18311",
                                            "--decode", "http://10.0.0.3:18312"]
    assert [n.role for n in dep.containers()] == ["prefill", "decode", "decode", "router"]
    copies = [w for w in dep.warnings if "needs the API key file" in w]
    assert len(copies) == 2 and "on b " in copies[0] and "on c " in copies[1]


def test_pp3_warns_that_mtp_under_deep_pipeline_is_unproven():
    assert any("pipeline parallel above 2 is not established" in w for w in deployment("tp2", PARALLEL="pp3").warnings)
    assert not any("pipeline" in w for w in deployment("tp2", PARALLEL="pp3", MTP="0").warnings)
    assert not any("pipeline" in w for w in deployment("tp2", PARALLEL="pp2").warnings)


@pytest.mark.parametrize("words,needles", [
    (["PARALLEL=tp3", "NODES=a,b,c", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3"],
     ["PARALLEL=tp3: vLLM refuses tensor parallel size 3", "replicated QSA KV heads", "pp3, dp3 or pd3"]),
    (["PARALLEL=dp5"], ["PARALLEL=dp5 spans 5 boxes; flash renders 2 to 4 boxes", "dp4"]),
    (["PARALLEL=pd5"], ["PARALLEL=pd5 spans 5 boxes"]),
    (["PARALLEL=tp8ep"], ["PARALLEL=tp8ep spans 8 boxes"]),
    (["PARALLEL=tp1"], ["PARALLEL=tp1 is one box", "PARALLEL=none"]),
    (["PARALLEL=tp4ep", "NODES=a,b,c", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3"],
     ["PARALLEL=tp4ep needs 4 boxes in NODES, got 3", "layouts for 3 boxes: pp3 | dp3 | pd3"]),
    (["PARALLEL=pd4", "NODES=a,b,c,d", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3"],
     ["needs one fast-link address per box in NODE_ADDRS (4), got 3", "10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4"]),
    (["PARALLEL=pd3", "NODES=a,b,c", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3", "NODE_GPUS=0,1"],
     ["NODE_GPUS has 2 entries for 3 boxes"]),
    (["PARALLEL=pd4", "NODES=a,b,c,d", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4", "PD_PORT=18297"],
     ["PD_PORT=18297 puts a pd server on PORT=18300 (prefill PD_PORT, decode PD_PORT+1..PD_PORT+3)"]),
    (["PARALLEL=pd3", "NODES=a,b,c", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3", "PD_PORT=65534"],
     ["would listen on 65536 (PD_PORT+2), beyond 65535", "PD_PORT at most 65533"]),
    (["PARALLEL=pd4", "NODES=a,b,c,d", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4", "NIXL_PORT=65534"],
     ["NIXL_PORT=65534: box 3's side channel would be 65537"]),
])
def test_bad_layouts_and_box_counts_exit_2_naming_the_value(words, needles, capsys):
    assert main(["serve", "tp2", "NODES=a,b", "NODE_ADDRS=10.0.0.1,10.0.0.2", *words, "--dry-run"]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


def test_dry_run_prints_every_box_of_four(capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/nonexistent")
    argvs, out = dry_run(capsys, "tp4ep", "NODES=a,b,c,d", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4")
    assert len(argvs) == 4 and all(a[:2] == ["docker", "run"] for a in argvs)
    assert [after(vllm_part(a), "--node-rank") for a in argvs] == ["0", "1", "2", "3"]
    assert ["--headless" in a for a in argvs] == [False, True, True, True]
    assert "# node 3 (worker) on d [ssh://d]" in out


def test_ports_and_inapplicable_settings_by_layout_kind():
    from flash_cli import exposure
    from flash_cli.spec import inapplicable

    p = profiles.load("tp2")
    s = resolve(p.layer(), {}, {**boxes_for(4), "PARALLEL": "pd4"}, profile_name=p.name)
    found = exposure.cluster_ports(s)
    assert [t for _, t in found if "NIXL side channel bound" in t][-1].startswith("box 3: NIXL side channel bound to "
                                                                                   "10.0.0.4:5603")
    s = resolve(p.layer(), {}, {**boxes_for(4), "PARALLEL": "tp4ep"}, profile_name=p.name)
    rule = next(t for _, t in exposure.cluster_ports(s) if "TCPStore" in t)
    assert "other 3 boxes" in rule and all(f"-s 10.0.0.{i} -j ACCEPT" in rule for i in (2, 3, 4))
    s = resolve(p.layer(), {}, {**boxes_for(3), "PARALLEL": "dp3", "MASTER_PORT": "29600"}, profile_name=p.name)
    assert inapplicable(s) == ["MASTER_PORT=29600 does nothing with PARALLEL=dp3: only tpN/ppN/tp2pp2 read it"]


def test_doctor_judges_four_boxes():
    facts = [box_facts(i) for i in range(4)]
    found = judged(*facts)
    assert not fails(found), fails(found)
    assert sum("Docker Engine reachable" in t for _, t in found) == 4
    facts[3] = box_facts(3, nccl="socket")
    assert any("node 3 (d): NCCL fell back to sockets" in t for t in fails(judged(*facts)))
    facts[3] = box_facts(3, image_id="sha256:" + "9" * 64)
    assert any("different images" in t and "node 3" in t for t in fails(judged(*facts)))


def test_plan_command_reports_each_box(capsys):
    assert main(["plan", "tp4ep", "NODES=a,b,c,d", "--hardware", "gb10", "--no-snapshot", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["parallel"]
    assert data["mode"] == "tp4ep" and data["boxes"] == 4 and [r["box"] for r in data["ranks"]] == [0, 1, 2, 3]
    assert [r["role"] for r in data["ranks"]] == ["head", "worker", "worker", "worker"]
    assert all(r["vllm_claim_gib"] > 0 and r["weights_gib"] < 20 for r in data["ranks"])
    assert main(["plan", "tp4ep", "--hardware", "gb10", "--no-snapshot"]) == 0
    text = capsys.readouterr().out
    assert "box 3          worker: vLLM claims" in text and "tp4ep (4 boxes)" in text


@pytest.mark.parametrize("mode", ["tp4ep", "tp2pp2", "pp3"])
def test_a_split_model_is_judged_per_box_not_as_one_box(capsys, mode):
    """At GPU_MEM=0.5 one Spark cannot hold the 73 GiB body, but each of 3-4 boxes holds its share:
    plan and doctor's memory findings pass, on each box's numbers; status's prediction is a rank's pool."""
    from flash_cli import plan as planner
    from flash_cli.plan import hardware

    assert main(["plan", "default", "GPU_MEM=0.5", "--hardware", "gb10", "--no-snapshot"]) == 1  # one box: no
    capsys.readouterr()
    argv = ["plan", "tp4ep", f"PARALLEL={mode}", "GPU_MEM=0.5", "--hardware", "gb10", "--no-snapshot", "--json"]
    assert main(argv) == 0, capsys.readouterr().out
    data = json.loads(capsys.readouterr().out)
    assert data["kv_cache_tokens"] == 0 and data["parallel"]["aggregate"]["kv_cache_tokens"] > 1_000_000
    assert data["findings"] and all(f["text"].startswith("each box: ") for f in data["findings"])
    assert "one box alone would have no KV pool" in data["parallel"]["note"]
    s = resolve(profiles.load("tp4ep").layer(), {}, {"PARALLEL": mode, "GPU_MEM": "0.5"}, profile_name="tp4ep")
    hw = hardware.preset("gb10")
    assert not [t for level, t in planner.doctor_findings(s, hw) if level == "fail"]
    tokens, lo, hi, _, _ = planner.prediction(s, hw)
    assert lo <= tokens <= hi and tokens == planner.deployed(s, hw)["rank"]["kv_cache_tokens"] > 0
    big = resolve(profiles.load("tp4ep").layer(), {}, {"PARALLEL": mode, "GPU_MEM": "0.2"}, profile_name="tp4ep")
    assert [t for level, t in planner.doctor_findings(big, hw) if level == "fail"]  # too little even split


# NVIDIA's two-Spark recipe as published (NVIDIA/local-ai-inference-recipes @dedcf6bc,
# dgx-spark-2gpu/linux/vllm/128gb/recipe.yaml): the head's and the worker's `vllm serve` flags
NVIDIA_TP2_ARGS = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "1", "--mamba-cache-mode", "align",
                   "--enable-prefix-caching", "--enable-chunked-prefill", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8",
                   "--quantization", "modelopt_mixed", "--block-size", "16", "--load-format", "b12x",
                   "--max-model-len", "262144", "--max-num-seqs", "16", "--max-num-batched-tokens", "4096",
                   "--speculative-config", '{"method":"mtp","num_speculative_tokens":4}', "--gdn-decode-kernel", "b12x",
                   "--linear-backend", "b12x", "--moe-backend", "b12x", "--no-enable-flashinfer-autotune",
                   "--mm-encoder-tp-mode", "data", "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_xml",
                   "--enable-auto-tool-choice", "--compilation-config", '{"pass_config":{"fuse_act_quant":true}}',
                   "--gpu-memory-utilization", "0.7", "--nnodes", "2", "--master-port", "29501"]
NVIDIA_TP2_ENV = {"CUTE_DSL_ARCH": "sm_121a", "SAFETENSORS_FAST_GPU": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                  "VLLM_SSM_CONV_STATE_LAYOUT": "DS", "VLLM_USE_AOT_COMPILE": "1", "VLLM_USE_MEGA_AOT_ARTIFACT": "1",
                  "VLLM_USE_V2_MODEL_RUNNER": "1", "B12X_POLICY_MODE": "auto", "VLLM_ENABLE_ROCE_ALLREDUCE": "1",
                  "VLLM_ROCE_ALLREDUCE_MAX_SIZE": "2MB", "NCCL_IGNORE_CPU_AFFINITY": "1", "NCCL_IB_DISABLE": "0"}


def _flag_values(argv: list[str]) -> dict[str, str | None]:
    """{flag: value (the last one given, as argparse keeps it) or None for a bare switch}."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


@pytest.mark.parametrize("node", [0, 1])
def test_nvidia_tp2_renders_the_two_spark_recipe_on_each_box(node):
    dropped = profiles.b12x_items(profiles.load("nvidia-tp2").path)
    assert dropped
    spec = deployment("nvidia-tp2").nodes[node].spec
    argv = list(spec.command)
    have = _flag_values(argv)
    for flag, val in _flag_values(NVIDIA_TP2_ARGS).items():
        word = f"{flag} {val}" if val is not None else flag
        if word in dropped:
            assert have.get(flag) != val, word  # a B12x item: not rendered (safetensors loads instead)
        elif flag == "--compilation-config":  # theirs plus the graph mode the hoisted gather is proven in
            assert json.loads(have[flag])["pass_config"] == json.loads(val)["pass_config"]
        elif flag == "--gpu-memory-utilization":
            assert float(have[flag]) == float(val)
        elif flag == "--pipeline-parallel-size":  # vLLM's default: not rendered
            assert flag not in have
        elif flag == "--speculative-config":
            assert json.loads(have[flag]) == json.loads(val)
        else:
            assert have.get(flag, "<absent>") == val, flag
    assert have["--node-rank"] == str(node) and have["--master-addr"] == "10.0.0.1"
    assert ("--headless" in argv) == (node == 1)
    for k, v in NVIDIA_TP2_ENV.items():
        assert spec.env.get(k) == v or f"{k}={v}" in dropped, k
    assert set(dropped) <= {f"{f} {v}" for f, v in _flag_values(NVIDIA_TP2_ARGS).items()} | {
        f"{k}={v}" for k, v in NVIDIA_TP2_ENV.items()}


def test_preflight_checks_the_layout_against_the_checkpoints_own_heads(tmp_path):
    """tp2 suits the published model (32 QSA heads) but not a checkpoint with 3: serve's preflight
    reads its config.json and refuses before any box starts; dp2 (whole copies) still passes."""
    from flash_cli import preflight

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 3}}))
    s = resolve(profiles.load("tp2").layer(), {}, boxes_for(2), profile_name="tp2")
    (p,) = preflight.parallel_problems(s, tmp_path)
    assert "its 3 QSA attention heads do not divide by 2" in p.message and str(tmp_path) in p.message
    assert "tp2" not in p.hint.split(": ", 1)[1].split(" | ") and "dp2" in p.hint
    dp = resolve(profiles.load("dp2").layer(), {}, boxes_for(2), profile_name="dp2")
    assert preflight.parallel_problems(dp, tmp_path) == []
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 32}}))
    assert preflight.parallel_problems(s, tmp_path) == []
