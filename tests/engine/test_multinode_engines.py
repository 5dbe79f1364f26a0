"""Two to four boxes on real engines (issues 15, 35): Docker Engines on this machine (the tier's
daemon and private dockerds, each with its own socket, data root and exec root), the stand-in
playing each rank and checking the rank argv it was given, ranks meeting over loopback on the
head's rendezvous port. A worker killed during boot, an unreachable box, and an image mismatch
doctor catches. pd: the prefill and decode stand-ins (NixlConnector handoff) behind flash's P/D
router, a third container on box 0 found by its label, the one endpoint flash test uses. Four
engines: tp4ep (four ranks meet), dp4; three: pd3 (the router spreads over two decode boxes and
keeps serving with one of them dead)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import IMAGE, free_port

pytestmark = pytest.mark.docker


@contextlib.contextmanager
def private_engine(docker_client, built_image):
    """A private Docker Engine (unix socket, own data/exec roots) holding the same image: one more box."""
    import docker

    if not shutil.which("dockerd"):
        pytest.fail("dockerd is not installed: tests/run engine installs docker.io")
    d = Path(tempfile.mkdtemp(prefix="fd2-", dir="/tmp"))
    sock = d / "d.sock"
    log = open(d / "dockerd.log", "wb")
    proc = subprocess.Popen(["dockerd", "--host", f"unix://{sock}", "--data-root", str(d / "root"),
                             "--exec-root", str(d / "x"), "--pidfile", str(d / "pid"), "--storage-driver=vfs",
                             "--iptables=false", "--ip6tables=false", "--bridge=none"], stdout=log, stderr=subprocess.STDOUT)
    url = f"unix://{sock}"
    client = None
    for _ in range(120):
        try:
            client = docker.DockerClient(base_url=url, timeout=600)
            client.ping()
            break
        except Exception:  # noqa: BLE001 - not up yet
            client = None
            time.sleep(0.5)
    if client is None:
        proc.terminate()
        pytest.fail("private dockerd did not answer:\n" + (d / "dockerd.log").read_text()[-2000:])
    try:
        client.images.load(b"".join(docker_client.images.get(built_image).save(named=True)))
        yield url, client
    finally:
        for c in client.containers.list(all=True):
            c.remove(force=True)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        netns = d / "x" / "netns" / "default"  # dockerd leaves its netns bind mount behind
        if netns.exists():
            subprocess.run(["umount", str(netns)], check=False, capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def second_engine(docker_client, built_image):
    with private_engine(docker_client, built_image) as engine:
        yield engine


@pytest.fixture(scope="module")
def more_engines(docker_client, built_image, second_engine):
    """Boxes 1-3 of a four-box deployment (issue 35): the second engine and two more private ones."""
    with private_engine(docker_client, built_image) as third, private_engine(docker_client, built_image) as fourth:
        yield [second_engine, third, fourth]


def boxes_env(url: str, **extra: str) -> dict:
    return {"NODES": f"localhost,{url}", "NODE_ADDRS": "127.0.0.1,127.0.0.1", "RDMA": "0",
            "MASTER_PORT": str(free_port()), "DP_RPC_PORT": str(free_port()), **extra}


def node(client, name: str, index: int):
    found = client.containers.list(all=True, filters={"label": [f"org.flash.name={name}", f"org.flash.node={index}"]})
    assert len(found) == 1, (name, index, found)
    return found[0]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def test_tp2_on_two_engines(flash, docker_client, second_engine):
    url, client2 = second_engine
    env = boxes_env(url)
    res = flash("serve", "tp2", "--start-check", "2", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    head, worker = node(docker_client, flash.name, 0), node(client2, flash.name, 1)
    assert not docker_client.containers.list(all=True, filters={"label": [f"org.flash.name={flash.name}", "org.flash.node=1"]})
    args = worker.attrs["Args"]
    assert "--headless" in args and args[args.index("--node-rank") + 1] == "1"
    assert args[args.index("--master-port") + 1] == env["MASTER_PORT"]
    assert "--headless" not in head.attrs["Args"]
    res = flash("wait", "--timeout", "120", "--interval", "0.5")  # boxes from the head's labels
    assert res.returncode == 0, res.stdout + res.stderr
    argv = get_json(f"{flash.url}/standin/argv")
    assert argv["ranks"] == {"rank": 0, "world": 2, "addr": "127.0.0.1", "port": int(env["MASTER_PORT"]), "kind": "tp"}
    head.reload()
    assert "rank 1 joined" in head.logs().decode()
    st = flash("status", "--json")
    rows = json.loads(st.stdout)["nodes"]
    assert [(r["node"], r["role"], r["state"]) for r in rows] == [(0, "head", "running"), (1, "worker", "running")]
    assert rows[0]["api"] == "up"
    logs = flash("logs", "--node", "1", "50")
    assert "Launching vLLM headless rank 1 (tp)" in logs.stdout, logs.stdout + logs.stderr
    again = flash("serve", "tp2", env=env)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    res = flash("stop", "--no-drain")
    assert res.returncode == 0 and "node 1 (worker)" in res.stdout, res.stdout + res.stderr
    res = flash("rm")
    assert res.returncode == 0, res.stderr
    assert not client2.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})
    assert not docker_client.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})


def test_dp2_one_endpoint(flash, docker_client, second_engine):
    url, client2 = second_engine
    env = boxes_env(url)
    res = flash("serve", "dp2", "--start-check", "2", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    worker = node(client2, flash.name, 1)
    args = worker.attrs["Args"]
    assert args[args.index("--data-parallel-start-rank") + 1] == "1" and "--headless" in args
    res = flash("wait", "--timeout", "120", "--interval", "0.5", env=env)  # boxes from NODES
    assert res.returncode == 0, res.stdout + res.stderr
    argv = get_json(f"{flash.url}/standin/argv")
    assert argv["ranks"]["kind"] == "dp" and argv["ranks"]["port"] == int(env["DP_RPC_PORT"])
    assert get_json(f"{flash.url}/v1/models")["data"][0]["id"] == "qwen3.8-flash-next"
    assert flash("rm", env=env).returncode == 0


def test_worker_killed_during_boot_fails_wait_at_once(flash, docker_client, second_engine):
    url, client2 = second_engine
    env = boxes_env(url, CONTAINER_ENV="STANDIN_BOOT_SECONDS=90")
    res = flash("serve", "tp2", "--start-check", "1", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    node(client2, flash.name, 1).kill()
    t0 = time.monotonic()
    res = flash("wait", "--timeout", "300", "--interval", "0.5")
    took = time.monotonic() - t0
    assert res.returncode == 7, res.stdout + res.stderr
    assert "node 1 (worker)" in res.stderr and "(headless)" in res.stderr  # its own log lines
    assert took < 20, took
    assert flash("rm").returncode == 0


def test_unreachable_box_changes_nothing(flash, docker_client):
    env = {"NODES": "localhost,unix:///tmp/flash-no-such-engine.sock", "NODE_ADDRS": "127.0.0.1,127.0.0.1", "RDMA": "0"}
    res = flash("serve", "tp2", env=env)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "box 1 (unix:///tmp/flash-no-such-engine.sock) is unreachable" in res.stderr
    assert not docker_client.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})


def test_doctor_catches_an_image_mismatch(flash, docker_client, second_engine):
    url, client2 = second_engine
    env = boxes_env(url)
    res = flash("doctor", "tp2", "--json", env=env)
    report = json.loads(res.stdout)
    texts = [(c["status"], c["text"]) for c in report["checks"]]
    assert ("ok", next(t for s, t in texts if t.startswith("same image on every box"))) in texts, texts
    revisions = [b["probe"]["revision"] for b in report["boxes"]]
    assert len(revisions) == 2 and revisions[0] == revisions[1] != ""
    assert all(b["probe"]["snapshot"] for b in report["boxes"])
    original = client2.images.get(IMAGE)
    other, _ = client2.images.build(fileobj=io.BytesIO(f"FROM {IMAGE}\nLABEL org.flash.test=mismatch\n".encode()),
                                    tag=IMAGE, rm=True)
    try:
        assert other.id != original.id
        res = flash("doctor", "tp2", "--json", env=env)
        assert res.returncode == 1, res.stdout + res.stderr
        fails = [c["text"] for c in json.loads(res.stdout)["checks"] if c["status"] == "fail"]
        assert any("the boxes run different images" in t for t in fails), fails
    finally:
        original.tag(IMAGE)
        client2.images.remove(other.id, force=True)


def test_one_box_server_and_deployment_of_one_name(flash, docker_client, second_engine):
    url, client2 = second_engine
    env = boxes_env(url)
    res = flash("serve", "published", "--start-check", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    res = flash("serve", "tp2", "--start-check", "1", env=env)
    assert res.returncode == 0 and "replacing the one-box server on box 0" in res.stderr, res.stdout + res.stderr
    assert len(docker_client.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})) == 1
    res = flash("serve", "published")
    assert res.returncode == 2 and "is a tp2 deployment" in res.stderr, res.stdout + res.stderr
    assert flash("rm").returncode == 0


def two_free_ports() -> int:
    import socket

    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise AssertionError("no two consecutive free ports")


def test_pd_router_is_one_endpoint_on_two_engines(flash, docker_client, second_engine):
    url, client2 = second_engine
    pd, nixl = two_free_ports(), free_port()
    env = boxes_env(url, PD_PORT=str(pd), NIXL_PORT=str(nixl), API_KEY="on")
    res = flash("serve", "pd", "--start-check", "2", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"P/D router on box 0): {flash.url}/v1" in res.stdout
    assert "does not ship" not in res.stdout + res.stderr
    prefill, decode = node(docker_client, flash.name, 0), node(client2, flash.name, 1)
    router = node(docker_client, flash.name, "router")
    assert router.name == f"{flash.name}-router" and router.labels["org.flash.role"] == "router"
    assert router.attrs["Args"][-4:] == ["--prefill", f"http://127.0.0.1:{pd}", "--decode", f"http://127.0.0.1:{pd + 1}"]
    assert "VLLM_API_KEY" not in " ".join(router.attrs["Config"]["Env"])  # the key file, never the key

    res = flash("wait", "--timeout", "120", "--interval", "0.5")  # boxes (and the router) from the labels
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"router on localhost: API {flash.url}/v1" in res.stdout

    key = (flash.home / ".local" / "state" / "flash" / f"api-key.{flash.name}").read_text().strip()
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    body = json.dumps({"model": "qwen3.8-flash-next", "prompt": "The capital of France is", "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{flash.url}/v1/completions", data=body, headers=auth)
    with urllib.request.urlopen(req, timeout=30) as r:
        answer = json.load(r)
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] > 0
    with pytest.raises(urllib.error.HTTPError) as no_key:
        urllib.request.urlopen(urllib.request.Request(f"{flash.url}/v1/completions", data=body,
                                                      headers={"Content-Type": "application/json"}), timeout=30)
    assert no_key.value.code == 401
    # the decode stand-in got the handoff the prefill stand-in answered (its side channel: box 0's)
    seen = get_json(f"http://127.0.0.1:{pd + 1}/standin/argv")["kv_seen"]
    assert seen[-1]["do_remote_prefill"] is True and seen[-1]["remote_port"] == nixl
    assert seen[-1]["remote_host"] == "127.0.0.1"
    assert get_json(f"http://127.0.0.1:{pd}/standin/argv")["kv_seen"][-1]["do_remote_decode"] is True

    res = flash("test", "TEST_PREFILL_TOKENS=1024", "TEST_DECODE_TOKENS=32", "TEST_DET_TOKENS=8", "TEST_DET_RUNS=2",
                "--json")  # finds the router by its labels: the deployment's one endpoint
    assert res.returncode == 0, res.stdout + res.stderr
    checks = {c["name"]: c["status"] for c in json.loads(res.stdout)["checks"]}
    assert checks["metrics"] == checks["tool_call"] == checks["prefix_cache"] == checks["context"] == "pass", checks
    with urllib.request.urlopen(f"{flash.url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'flash_router_requests_total{endpoint="completions",outcome="ok"}' in metrics
    assert 'stage="decode"' in metrics and 'stage="prefill"' in metrics

    st = json.loads(flash("status", "--json").stdout)["nodes"]
    assert [(r["node"], r["role"], r["state"]) for r in st] == [(0, "prefill", "running"), (1, "decode", "running"),
                                                               ("router", "router", "running")]
    assert st[2]["api"] == "up" and st[2]["url"] == f"{flash.url}/v1"
    text = flash("status").stdout
    assert f"pd deployment on 2 boxes, endpoint {flash.url}/v1 (P/D router)" in text and "router on localhost: " in text
    logs = flash("logs", "--node", "router", "50")
    assert "pdrouter: listening on 127.0.0.1:" in logs.stdout + logs.stderr and "API key required" in logs.stdout + logs.stderr

    decode.kill()  # one side down: the router says which, and wait fails at once naming the box
    try:
        urllib.request.urlopen(f"{flash.url}/health", timeout=10)
        raise AssertionError("/health answered 200 with the decode server dead")
    except urllib.error.HTTPError as exc:
        assert exc.code == 503 and json.loads(exc.read())["prefill"] == "ok"
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(urllib.request.Request(f"{flash.url}/v1/completions", data=body, headers=auth), timeout=30)
    # the router knows the decode server is down (its /health just said so): 503, and no prefill spent
    assert bad.value.code == 503 and json.loads(bad.value.read())["error"]["stage"] == "decode"
    res = flash("wait", "--timeout", "30", "--interval", "0.5")
    assert res.returncode == 7 and "node 1 (decode)" in res.stderr, res.stdout + res.stderr

    res = flash("stop", "--no-drain")
    assert res.returncode == 0 and res.stdout.splitlines()[0].startswith("router on localhost"), res.stdout + res.stderr
    res = flash("rm")
    assert res.returncode == 0 and "router on localhost: removed" in res.stdout, res.stdout + res.stderr
    for client in (docker_client, client2):
        assert not client.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})


def test_pd_server_port_in_use_changes_nothing(flash, docker_client, second_engine):
    import socket

    url, client2 = second_engine
    pd = two_free_ports()
    with socket.socket() as held:
        held.bind(("127.0.0.1", pd + 1))
        held.listen(1)
        res = flash("serve", "pd", "--start-check", "1", env=boxes_env(url, PD_PORT=str(pd)))
    assert res.returncode == 9, res.stdout + res.stderr
    assert f"port 127.0.0.1:{pd + 1} (the decode server's: PD_PORT+1) is already in use" in res.stderr
    for client in (docker_client, client2):
        assert not client.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})


# -- three and four boxes (issue 35) ------------------------------------------------------------
def n_boxes_env(urls: list[str], **extra: str) -> dict:
    n = len(urls) + 1
    return {"NODES": ",".join(["localhost", *urls]), "NODE_ADDRS": ",".join(["127.0.0.1"] * n), "RDMA": "0",
            "MASTER_PORT": str(free_port()), "DP_RPC_PORT": str(free_port()), **extra}


def test_tp4ep_on_four_engines(flash, docker_client, more_engines):
    env = n_boxes_env([u for u, _ in more_engines])
    res = flash("serve", "tp4ep", "--start-check", "2", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "starting on 4 boxes (tp4ep)" in res.stdout
    for i, (_, client) in enumerate(more_engines, start=1):
        args = node(client, flash.name, i).attrs["Args"]
        assert args[args.index("--node-rank") + 1] == str(i) and "--headless" in args
        assert args[args.index("--nnodes") + 1] == "4" and "--enable-expert-parallel" in args
    res = flash("wait", "--timeout", "180", "--interval", "0.5")  # all four boxes from the head's labels
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ready after" in res.stdout and ": 4 boxes" in res.stdout, res.stdout
    argv = get_json(f"{flash.url}/standin/argv")
    assert argv["ranks"] == {"rank": 0, "world": 4, "addr": "127.0.0.1", "port": int(env["MASTER_PORT"]), "kind": "tp"}
    head = node(docker_client, flash.name, 0)
    head.reload()
    assert all(f"rank {r} joined" in head.logs().decode() for r in (1, 2, 3))
    rows = json.loads(flash("status", "--json").stdout)["nodes"]
    assert [(r["node"], r["role"], r["state"]) for r in rows] == [(0, "head", "running")] + \
        [(i, "worker", "running") for i in (1, 2, 3)]
    logs = flash("logs", "--node", "3", "50")
    assert "Launching vLLM headless rank 3 (tp)" in logs.stdout, logs.stdout + logs.stderr
    lost = node(more_engines[1][1], flash.name, 2)
    lost.kill()  # a lost rank: wait names it at once
    for _ in range(120):  # its engine records the exit on its own time (the kill call can return first)
        lost.reload()
        if lost.status == "exited":
            break
        time.sleep(0.25)
    res = flash("wait", "--timeout", "60", "--interval", "0.5")
    states = {i: node(c, flash.name, i).status for i, c in enumerate([docker_client] + [c for _, c in more_engines])}
    assert res.returncode == 7 and "node 2 (worker)" in res.stderr, (states, res.stdout + res.stderr)
    res = flash("stop", "--no-drain")
    assert res.returncode == 0 and "node 3 (worker)" in res.stdout, res.stdout + res.stderr
    assert flash("rm").returncode == 0
    for client in [docker_client] + [c for _, c in more_engines]:
        assert not client.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})


def test_dp4_one_endpoint_on_four_engines(flash, docker_client, more_engines):
    env = n_boxes_env([u for u, _ in more_engines])
    res = flash("serve", "dp2", "PARALLEL=dp4", "--start-check", "2", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    for i, (_, client) in enumerate(more_engines, start=1):
        args = node(client, flash.name, i).attrs["Args"]
        assert args[args.index("--data-parallel-start-rank") + 1] == str(i)
        assert args[args.index("--data-parallel-size") + 1] == "4" and "--headless" in args
    res = flash("wait", "--timeout", "180", "--interval", "0.5", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    argv = get_json(f"{flash.url}/standin/argv")
    assert argv["ranks"]["kind"] == "dp" and argv["ranks"]["world"] == 4
    assert get_json(f"{flash.url}/v1/models")["data"][0]["id"] == "qwen3.8-flash-next"
    assert flash("rm", env=env).returncode == 0


def test_pd3_router_spreads_over_two_decode_engines(flash, docker_client, more_engines):
    import socket

    (url1, client1), (url2, client2) = more_engines[:2]
    pd = None
    for _ in range(50):  # three consecutive free ports
        p = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p + 1))
                b.bind(("127.0.0.1", p + 2))
            pd = p
            break
        except OSError:
            continue
    assert pd is not None
    # one router worker: "in turn" below is one process's order (with workers each keeps its own turn,
    # so 4 requests split 3/1 or 2/2 by which worker accepts them; the shared health verdicts of
    # several workers are the pd test's and tests/unit/test_pdrouter_attacks.py's)
    env = n_boxes_env([url1, url2], PD_PORT=str(pd), NIXL_PORT=str(free_port()), API_KEY="off", ROUTER_WORKERS="1")
    res = flash("serve", "pd3", "--start-check", "2", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    router = node(docker_client, flash.name, "router")
    assert router.attrs["Args"][-6:] == ["--prefill", f"http://127.0.0.1:{pd}", "--decode", f"http://127.0.0.1:{pd + 1}",
                                         "--decode", f"http://127.0.0.1:{pd + 2}"]
    res = flash("wait", "--timeout", "120", "--interval", "0.5")
    assert res.returncode == 0, res.stdout + res.stderr
    assert get_json(f"{flash.url}/health") == {"prefill": "ok", "decode1": "ok", "decode2": "ok"}
    body = json.dumps({"model": "qwen3.8-flash-next", "prompt": "The capital of France is", "max_tokens": 4}).encode()

    def complete() -> dict:
        req = urllib.request.Request(f"{flash.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)
    for _ in range(4):
        assert complete()["choices"][0]["text"]
    seen = [len(get_json(f"http://127.0.0.1:{pd + i}/standin/argv")["kv_seen"]) for i in (1, 2)]
    assert seen == [2, 2], seen  # nothing outstanding between requests: in turn
    st = json.loads(flash("status", "--json").stdout)["nodes"]
    assert [(r["node"], r["role"]) for r in st] == [(0, "prefill"), (1, "decode"), (2, "decode"), ("router", "router")]
    node(client2, flash.name, 2).kill()  # one decode box down: the other one serves, /health says which
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"{flash.url}/health", timeout=10)
    assert health.value.code == 503 and json.loads(health.value.read())["decode1"] == "ok"
    for _ in range(3):
        assert complete()["choices"][0]["text"]
    node(client1, flash.name, 1).kill()  # both down: 503 naming decode, no prefill spent
    prefills = len(get_json(f"http://127.0.0.1:{pd}/standin/argv")["kv_seen"])
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{flash.url}/health", timeout=10)  # the router now knows both are down
    with pytest.raises(urllib.error.HTTPError) as bad:
        complete()
    assert bad.value.code == 503 and json.loads(bad.value.read())["error"]["stage"] == "decode"
    assert len(get_json(f"http://127.0.0.1:{pd}/standin/argv")["kv_seen"]) == prefills
    res = flash("rm")
    assert res.returncode == 0 and "router on localhost: removed" in res.stdout, res.stdout + res.stderr
    for client in (docker_client, client1, client2):
        assert not client.containers.list(all=True, filters={"label": f"org.flash.name={flash.name}"})
