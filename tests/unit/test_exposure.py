"""What a recipe opens to the network (issue 34): one open-API check shared by single-box serve,
pd's router and doctor; the distributed ports of each mode and plaintext tcp:// engines in doctor."""

from __future__ import annotations

import json

import pytest

from flash_cli import exposure, profiles
from flash_cli.__main__ import main
from flash_cli.settings import resolve

OPEN = "WITHOUT an API key (API_KEY=off)"


def settings(profile: str, **kv):
    p = profiles.load(profile)
    return resolve(p.layer(), {}, kv, profile_name=p.name)


def test_open_api_is_one_check():
    assert exposure.open_api("127.0.0.1", 1, "off") is None and exposure.open_api("::1", 1, "off") is None
    assert exposure.open_api("0.0.0.0", 1, "auto") is None and exposure.open_api("10.0.0.1", 1, "on") is None
    assert OPEN in exposure.open_api("0.0.0.0", 18300, "off") and "0.0.0.0:18300" in exposure.open_api("0.0.0.0", 18300, "off")


def test_pd_public_bind_without_key_warns_like_single_box_serve(capsys):
    # the repro: `serve pd … BIND=0.0.0.0 API_KEY=off` warned nowhere
    assert main(["serve", "default", "BIND=0.0.0.0", "API_KEY=off", "--dry-run"]) == 0
    one = capsys.readouterr()
    assert OPEN in one.out + one.err
    assert main(["serve", "pd", "NODES=localhost,localhost", "NODE_ADDRS=127.0.0.1,127.0.0.1", "BIND=0.0.0.0",
                 "API_KEY=off", "--dry-run"]) == 0
    pd = capsys.readouterr()
    assert f"the P/D router: API published on 0.0.0.0:18300 {OPEN}" in pd.out + pd.err
    assert main(["serve", "pd", "NODES=localhost,localhost", "NODE_ADDRS=127.0.0.1,127.0.0.1", "--dry-run"]) == 0
    assert OPEN not in "".join(capsys.readouterr())


@pytest.mark.parametrize("mode", ["tp2", "pp2"])
def test_tp_store_on_every_interface_is_named_with_its_port(mode):
    s = settings("tp2", PARALLEL=mode, NODES="a,b", NODE_ADDRS="10.0.0.1,10.0.0.2", MASTER_PORT="29611")
    found = exposure.cluster_ports(s)
    store = [t for lvl, t in found if lvl == "warn" and "TCPStore" in t]
    assert store and "every interface at 29611" in store[0] and "--dport 29611" in store[0]
    # the rules, in order: the head's own connections (loopback, its own address) and the other box
    # accepted before the DROP, or the head's own ranks could not reach the store it serves
    rules = [r.strip() for r in store[0].split("e.g. ", 1)[1].split(";")]
    assert rules == ["iptables -A INPUT -p tcp --dport 29611 -i lo -j ACCEPT",
                     "iptables -A INPUT -p tcp --dport 29611 -s 10.0.0.1 -j ACCEPT",
                     "iptables -A INPUT -p tcp --dport 29611 -s 10.0.0.2 -j ACCEPT",
                     "iptables -A INPUT -p tcp --dport 29611 -j DROP"]
    assert ("warn", next(t for _, t in found if t.startswith("NODE_IFNAME is empty"))) in found


def test_nccl_interface_named_is_ok_and_dp_handshake_is_bound():
    s = settings("dp2", NODES="a,b", NODE_ADDRS="10.0.0.1,10.0.0.2", NODE_IFNAME="enp1s0f1np1")
    found = exposure.cluster_ports(s)
    assert ("ok", "NCCL and gloo sockets on enp1s0f1np1 (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)") in found
    assert any(lvl == "ok" and "bound to 10.0.0.1:29550" in t for lvl, t in found)
    assert not any(lvl != "ok" for lvl, _ in found), found


def test_pd_side_channels_bound_to_each_box_and_port_clashes_fail():
    s = settings("pd", NODES="a,b", NODE_ADDRS="10.0.0.1,10.0.0.2")
    found = exposure.cluster_ports(s)
    assert any("box 1: NIXL side channel bound to 10.0.0.2:5601" in t and "10.0.0.2:18311" in t for _, t in found)
    clash = exposure.cluster_ports(settings("pd", NODES="a,b", NODE_ADDRS="10.0.0.1,10.0.0.2", NIXL_PORT="18310"))
    assert any(lvl == "fail" and "port 18310 is both NIXL side channel of box 0 and pd server 0's API" in t
               for lvl, t in clash), clash


def test_plaintext_tcp_engine_warns_and_ssh_does_not():
    assert exposure.plaintext_engines("me@spark2,unix:///run/d.sock,localhost") == []
    (w,) = exposure.plaintext_engines("localhost,tcp://10.0.0.2:2375")
    assert "'tcp://10.0.0.2:2375'" in w and "neither encryption nor authentication" in w and "ssh://" in w


def test_doctor_reports_ports_and_plaintext_engines(monkeypatch, capsys):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")  # both boxes unreachable, at once
    rc = main(["doctor", "tp2", "NODES=localhost,tcp://127.0.0.1:9", "NODE_ADDRS=127.0.0.1,127.0.0.1", "--json"])
    assert rc == 1  # the unreachable boxes fail; the network findings are there beside them
    checks = json.loads(capsys.readouterr().out)["checks"]
    ports = [(c["status"], c["text"]) for c in checks if c.get("section") == "ports"]
    assert any(s == "warn" and "'tcp://127.0.0.1:9'" in t and "plain tcp://" in t for s, t in ports), ports
    assert any(s == "warn" and "TCPStore" in t for s, t in ports), ports
