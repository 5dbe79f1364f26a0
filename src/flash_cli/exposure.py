"""PURE: what a recipe opens to the network, judged in one place (issue 34).

`open_api` is the one check for an API published beyond loopback without a key: `serve`'s run spec
(one box and each pd server), the pd router and `doctor` all call it, so a pd deployment warns as a
single box does. `cluster_ports` lists every port the ranks of a multi-node deployment listen on,
where each one is bound and whether vLLM lets us bind it to the fast link (docs/MULTINODE.md),
plus the engines flash reaches without encryption; `doctor` prints the findings.

Read from vLLM 0.33.0's source (the same in 0.29-0.32 for what is used here):
  * tp/pp rendezvous: `--nnodes N` makes every rank call torch.distributed with
    tcp://MASTER_ADDR:MASTER_PORT (vllm/distributed/parallel_state.py); rank 0's torch TCPStore
    server listens on every interface at MASTER_PORT: torch offers no bind address, and vLLM passes
    no pre-bound socket on this path. It can only be firewalled.
  * NCCL and gloo open their bootstrap and socket-transport listeners on the interface named by
    NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (flash sets both from NODE_IFNAME); unset, NCCL picks
    the first interface that is up, which on a Spark can be the management network.
  * dp: the handshake (--data-parallel-rpc-port) and the stateless gloo group bind to
    --data-parallel-address, the head's fast-link address (vllm/config/parallel.py).
  * pd layouts: the NIXL side channel is a ZMQ ROUTER bound to VLLM_NIXL_SIDE_CHANNEL_HOST:PORT
    (kv_connector/v1/nixl/base_scheduler.py), which flash sets to each box's NODE_ADDRS address.
  * VLLM_HOST_IP (set per box) is the address vLLM advertises to the other ranks.
"""

from __future__ import annotations

import ipaddress

from . import layout, nodes


def _loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def open_api(bind: str, port: int, api_key: str) -> str | None:
    """The warning for an API anyone who reaches BIND:PORT may use; None when it is keyed or local."""
    if _loopback(bind) or api_key != "off":
        return None
    return (f"API published on {bind}:{port} WITHOUT an API key (API_KEY=off): anyone who can reach this port "
            "can use the model")


def plaintext_engines(text: str | None) -> list[str]:
    """One warning per NODES box whose Docker Engine API crosses the network in the clear."""
    out = []
    for b in nodes.parse(text):
        if b.plaintext:
            out.append(f"NODES entry {b.written!r}: the Docker Engine API over plain tcp:// has neither encryption "
                       "nor authentication (whoever reaches that port is root on the box); use ssh:// "
                       "(NODES=user@host) instead")
    return out


def cluster_ports(s) -> list[tuple[str, str]]:
    """(level, text) for the ports the ranks of s's deployment listen on, and for the engines' links."""
    if s["PARALLEL"] == "none":
        return []
    lay = layout.parse(s["PARALLEL"])
    addrs = [a.strip() for a in (s["NODE_ADDRS"] or "").split(",") if a.strip()]
    head = addrs[0] if addrs else "?"
    out: list[tuple[str, str]] = [("warn", w) for w in plaintext_engines(s["NODES"])]
    ports: dict[int, str] = {}

    def claim(port: int, what: str) -> None:
        if port in ports:
            out.append(("fail", f"port {port} is both {ports[port]} and {what}: give one of them another port"))
        ports[port] = what

    if lay.rendezvous:
        claim(s["MASTER_PORT"], "MASTER_PORT (torch store)")
        others = [a for a in addrs[1:] if a != head] or ["<the other boxes' fast-link addresses>"]
        # the head's own ranks reach the store over loopback (or from its own address): accepted first
        rules = "; ".join([f"iptables -A INPUT -p tcp --dport {s['MASTER_PORT']} -i lo -j ACCEPT"]
                          + [f"iptables -A INPUT -p tcp --dport {s['MASTER_PORT']} -s {a} -j ACCEPT"
                             for a in ([head] if head != "?" else []) + others])
        out.append(("warn", f"torch's TCPStore on the head listens on every interface at {s['MASTER_PORT']} "
                            f"(MASTER_PORT), not only {head}: torch has no bind address for it and vLLM passes none. "
                            f"Firewall it to the other {'box' if lay.boxes == 2 else f'{lay.boxes - 1} boxes'}, e.g. "
                            f"{rules}; iptables -A INPUT -p tcp --dport {s['MASTER_PORT']} -j DROP"))
    if lay.kind == "dp":
        claim(s["DP_RPC_PORT"], "DP_RPC_PORT (data-parallel handshake)")
        out.append(("ok", f"data-parallel handshake bound to {head}:{s['DP_RPC_PORT']} (--data-parallel-address)"))
    if lay.nccl:
        if s["NODE_IFNAME"]:
            out.append(("ok", f"NCCL and gloo sockets on {s['NODE_IFNAME']} (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)"))
        else:
            out.append(("warn", "NODE_IFNAME is empty: NCCL and gloo listen on the first interface that is up, which "
                                "can be the management network; set NODE_IFNAME to the fast link's interface "
                                "(e.g. enp1s0f1np1)"))
    if lay.kind == "pd":
        for i, a in enumerate(addrs):
            claim(s["NIXL_PORT"] + i, f"NIXL side channel of box {i}")
            claim(s["PD_PORT"] + i, f"pd server {i}'s API")
            out.append(("ok", f"box {i}: NIXL side channel bound to {a}:{s['NIXL_PORT'] + i} "
                              f"(VLLM_NIXL_SIDE_CHANNEL_HOST), its API to {a}:{s['PD_PORT'] + i}"))
        claim(s["PORT"], "the router's API (PORT)")  # the router's open_api check: doctor's profile step
    else:
        claim(s["PORT"], "the API (PORT)")
    return out
