"""PURE: one deployment over 2 to 4 boxes with vLLM's own multi-node modes → one RunSpec per box.

No cluster manager of our own: every box runs the same image with its rank's `vllm serve` argv
and vLLM does the rest (docs/MULTINODE.md). This module only decides, from the settings, what
each box gets; `deploy.py` starts them through each box's Docker Engine, `serve --dry-run`
prints them, and the golden files pin them (tests/golden/serve/<profile>.node<N>.txt).

Layouts (PARALLEL, parsed and checked against the model's head counts by layout.py), N boxes
with one GPU each:
  tpN, tpNep, ppN, tp2pp2   one model over the boxes: --tensor-parallel-size T and/or
       --pipeline-parallel-size P (tpNep adds --enable-expert-parallel), --nnodes N --node-rank r
       --master-addr A0 --master-port P; ranks r > 0 add --headless. The head serves the API.
  dpN  N replicas, vLLM's internal load balancing behind the head's one API:
       --data-parallel-size N --data-parallel-size-local 1 --data-parallel-address A0
       --data-parallel-rpc-port R; ranks r > 0 add --data-parallel-start-rank r --headless.
  pd, pdN   prefill on box 0, decode on boxes 1..N-1, KV moved by NIXL: servers with
       --kv-transfer-config {"kv_connector":"NixlConnector","kv_role":"kv_producer"|"kv_consumer"},
       each listening on its fast-link address at PD_PORT+r, and one more container on box 0,
       flash's P/D router (`python3 -m flash_vllm.pdrouter`, same image, one --decode per decode
       server), serving the one API on BIND:PORT (docs/MULTINODE.md).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from . import layout as layout_mod
from . import nodes as nodes_mod
from .errors import ConfigError
from .exposure import open_api
from .settings import Settings
from .spec import KEY_TARGET, LABEL, HF_MOUNT, Mount, RunSpec, build, extra_env, is_loopback

# ==== per-release facts (the one place) ==========================================================
# None differs between the catalogued releases, so nothing here asks flash_common.releases; a flag
# that one day differs becomes a capability there (`cap(base, …)`), never a release name here.
# Read from the wheels' sources (vllm/engine/arg_utils.py, vllm/entrypoints/cli/serve.py,
# vllm/config/parallel.py, vllm/config/kv_transfer.py, .../kv_connector/v1/nixl/connector.py):
# every flag below exists with the same meaning in 0.29.0 and 0.33.0 (sources read), and the vllm
# tier parses the rendered argv of every box with each catalogued release's own parser (0.29-0.33)
# (tests/vllm/release/check_multinode_argv.py). `kv_role="kv_both"` is deprecated for
# NixlConnector in both ("use kv_producer for prefill instances and kv_consumer for decode").
# Defaults quoted for the settings table: ParallelConfig.master_port 29501,
# data_parallel_rpc_port 29550, envs.VLLM_NIXL_SIDE_CHANNEL_PORT 5600.
NIXL_CONNECTOR = "NixlConnector"
NIXL_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
# ==============================================================================================

RDMA_DEVICE = "/dev/infiniband"
NCCL_LOG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}  # doctor reads the transport


@dataclass(frozen=True)
class Node:
    index: int
    box: str  # as written in NODES
    engine: str  # Docker Engine URL; "" = this machine's (DOCKER_HOST or the default socket)
    addr: str  # address on the fast link
    role: str  # head | worker | prefill | decode
    gpus: list[str]  # CUDA device indices for this rank; empty = all
    serves_api: bool
    spec: RunSpec

    def plain(self, hf_cache: str) -> dict:
        """This rank without Docker (issue 17: two "nodes" on one host): the same `vllm serve`
        argv and environment, container paths mapped back to the host's HF cache, the GPUs
        chosen with CUDA_VISIBLE_DEVICES."""
        def host_path(v: str) -> str:
            return hf_cache + v[len(HF_MOUNT):] if v == HF_MOUNT or v.startswith(HF_MOUNT + "/") else v

        env = {k: host_path(v) for k, v in self.spec.env.items()}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return {"node": self.index, "role": self.role, "addr": self.addr, "argv": [host_path(a) for a in self.spec.command],
                "env": env}


@dataclass(frozen=True)
class Deployment:
    name: str
    parallel: str
    nodes: list[Node]
    warnings: list[str] = field(default_factory=list)
    router: Node | None = None  # pd layouts: the P/D router on box 0, the deployment's one endpoint

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def api_urls(self) -> list[str]:
        """Where users send requests: the router for pd, else the box(es) serving the API."""
        if self.router is not None:
            return [self.router.spec.api_url]
        return [n.spec.api_url for n in self.nodes if n.serves_api]

    def containers(self) -> list[Node]:
        """Every container of the deployment in start order (the router last: its health needs both)."""
        return self.nodes + ([self.router] if self.router is not None else [])


def engine_url(box: str) -> str:
    """`localhost` → "" (this machine's engine); `host`/`user@host` → ssh://; URLs as written
    (nodes.py checks every form)."""
    return nodes_mod.parse_one(box).url


def _split(s: Settings, key: str) -> list[str]:
    return [w.strip() for w in (s[key] or "").split(",") if w.strip()]


def boxes(s: Settings) -> tuple[list[str], list[str], list[list[str]]]:
    """NODES, NODE_ADDRS, NODE_GPUS as lists, checked against each other and against PARALLEL."""
    mode = s["PARALLEL"]
    want = layout_mod.parse(mode).boxes
    nodes, addrs = [b.written for b in nodes_mod.parse(s["NODES"])], _split(s, "NODE_ADDRS")
    gpus = [g.split("+") for g in _split(s, "NODE_GPUS")]
    example = ",".join(f"10.0.0.{i + 1}" for i in range(want))
    if len(nodes) != want:
        names = ",".join(["head"] + [f"box{i}" for i in range(1, want)])
        fits = [a for a in layout_mod.ACCEPTED if layout_mod.parse(a).boxes == len(nodes)]
        raise ConfigError(f"PARALLEL={mode} needs {want} boxes in NODES, got {len(nodes)} ({s['NODES'] or 'empty'})",
                          hint=f"NODES={names} (localhost, a host name, user@host or an engine URL), head first"
                               + (f"; layouts for {len(nodes)} boxes: {' | '.join(fits)}" if fits else ""))
    if len(addrs) != want:
        raise ConfigError(f"PARALLEL={mode} needs one fast-link address per box in NODE_ADDRS ({want}), got {len(addrs)} "
                          f"({s['NODE_ADDRS'] or 'empty'})", hint=f"NODE_ADDRS={example} (head first)")
    import ipaddress

    for a in addrs:
        try:
            ipaddress.ip_address(a)
        except ValueError:
            raise ConfigError(f"NODE_ADDRS entry {a!r} is not an IP address",
                              hint=f"NODE_ADDRS takes the boxes' IP addresses on the fast link, e.g. {example}") from None
    if gpus and len(gpus) != want:
        raise ConfigError(f"NODE_GPUS has {len(gpus)} entries for {want} boxes ({s['NODE_GPUS']})",
                          hint=f"one entry per box, e.g. NODE_GPUS={','.join(str(i) for i in range(want))} "
                               f"({want} ranks on one host)")
    if s["NETWORK"] != "host":
        raise ConfigError(f"PARALLEL={mode} needs NETWORK=host (NETWORK={s['NETWORK']}): the ranks meet on the "
                          "boxes' own addresses (NCCL, the rendezvous and handshake ports)",
                          hint="NETWORK=host (the multi-node profiles set it)")
    # The same address twice is allowed: ranks sharing one host over loopback (issue 17).
    return nodes, addrs, gpus or [[] for _ in nodes]


def rank_args(s: Settings, lay: layout_mod.Layout, index: int, addrs: list[str]) -> tuple[str, list[str]]:
    """(role, the `vllm serve` flags of this box) for each layout."""
    head, role = addrs[0], lay.roles()[index]
    n = str(lay.boxes)
    if lay.rendezvous:
        argv = (["--tensor-parallel-size", str(lay.tp)] if lay.tp > 1 else []) \
            + (["--pipeline-parallel-size", str(lay.pp)] if lay.pp > 1 else []) \
            + (["--enable-expert-parallel"] if lay.ep else []) \
            + ["--nnodes", n, "--node-rank", str(index), "--master-addr", head, "--master-port", str(s["MASTER_PORT"])]
        return role, argv + (["--headless"] if role == "worker" else [])
    if lay.kind == "dp":
        argv = ["--data-parallel-size", n, "--data-parallel-size-local", "1", "--data-parallel-address", head,
                "--data-parallel-rpc-port", str(s["DP_RPC_PORT"])]
        return role, argv + (["--data-parallel-start-rank", str(index), "--headless"] if role == "worker" else [])
    cfg = {"kv_connector": NIXL_CONNECTOR, "kv_role": NIXL_ROLE[role]}
    return role, ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]


def node_env(s: Settings, lay: layout_mod.Layout, index: int, addr: str) -> dict[str, str]:
    env = {"VLLM_HOST_IP": addr}
    if lay.nccl:
        env.update(NCCL_LOG_ENV)
        if s["NODE_IFNAME"]:
            env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = s["NODE_IFNAME"]
    else:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = addr
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(s["NIXL_PORT"] + index)
    return env


def pd_key(s: Settings, addrs: list[str]) -> bool:
    """One key for the whole pd deployment: required when API_KEY=on, or (auto) when the router's
    BIND or a server's fast-link address is beyond loopback (secure by default, as on one box)."""
    mode = s["API_KEY"]
    return mode == "on" or (mode == "auto" and not all(is_loopback(a) for a in [s["BIND"], *addrs]))


def pd_ports(s: Settings, n: int) -> list[int]:
    """The pd servers' API ports: PD_PORT + box index, none of them the router's PORT, all real ports;
    the NIXL side channels (NIXL_PORT + box index) likewise."""
    ports = [s["PD_PORT"] + i for i in range(n)]
    last = f"PD_PORT+{n - 1}" if n > 2 else "PD_PORT+1"
    if s["PORT"] in ports:
        raise ConfigError(f"PD_PORT={s['PD_PORT']} puts a pd server on PORT={s['PORT']} (prefill PD_PORT, decode "
                          f"PD_PORT+1{f'..{last}' if n > 2 else ''}), where the router serves the deployment's one API",
                          hint=f"a PD_PORT outside {s['PORT'] - n + 1}..{s['PORT']}, e.g. PD_PORT={s['PORT'] + 10}")
    if ports[-1] > 65535:
        raise ConfigError(f"PD_PORT={s['PD_PORT']}: the decode server on box {n - 1} would listen on {ports[-1]} "
                          f"({last}), beyond 65535", hint=f"PD_PORT at most {65535 - n + 1}")
    if s["NIXL_PORT"] + n - 1 > 65535:
        raise ConfigError(f"NIXL_PORT={s['NIXL_PORT']}: box {n - 1}'s side channel would be {s['NIXL_PORT'] + n - 1} "
                          f"(NIXL_PORT+{n - 1}), beyond 65535", hint=f"NIXL_PORT at most {65535 - n + 1}")
    return ports


def router_spec(s: Settings, servers: list[Node], *, profile: str, state_dir: str, key: bool) -> RunSpec:
    """The P/D router's container on box 0: the same image, no GPU, no model, the deployment's
    labels with node=router; the key file mounted and read by flash_vllm.launch as on one box."""
    head = servers[0].spec
    bind, port = s["BIND"], s["PORT"]
    def url(n: Node) -> str:
        return f"http://{n.addr if ':' not in n.addr else f'[{n.addr}]'}:{n.spec.labels[f'{LABEL}.port']}"

    decodes = [a for n in servers if n.role == "decode" for a in ("--decode", url(n))]
    keep = ("name", "profile", "base", "image", "served-model-name", "settings", "recipe", "version",
            "parallel", "nodes", "node-addrs")
    labels = {k: v for k, v in head.labels.items() if k.removeprefix(f"{LABEL}.") in keep}
    labels.update({f"{LABEL}.port": str(port), f"{LABEL}.bind": bind, f"{LABEL}.api-key": "required" if key else "none",
                   f"{LABEL}.node": "router", f"{LABEL}.role": "router"})
    env = {"FLASH_API_KEY_FILE": KEY_TARGET} if key else {}
    mounts = [Mount("bind", KEY_TARGET, head.key_file, read_only=True)] if key else []
    probe = ["--health", str(port)] + ([bind] if bind not in ("0.0.0.0", "::", "127.0.0.1") else [])
    url_host = "127.0.0.1" if bind in ("0.0.0.0", "::") or is_loopback(bind) else bind
    return RunSpec(
        name=f"{s['NAME']}-router", image=head.image, entrypoint=["python3", "-m", "flash_vllm.launch"],
        command=["python3", "-m", "flash_vllm.pdrouter", "--host", bind, "--port", str(port),
                 "--workers", str(s["ROUTER_WORKERS"]), "--prefill", url(servers[0]), *decodes],
        env=env, labels=labels, mounts=mounts, network="host", ports={}, restart=s["RESTART"], gpus=False,
        ipc="private", shm_size=64 * 2**20, log_max_size=s["LOG_MAX_SIZE"], log_max_files=s["LOG_MAX_FILES"],
        cpuset=None,
        # healthy = every server answers /health through the router (a 10-minute boot: the same start period)
        healthcheck={"test": ["CMD", "python3", "-m", "flash_vllm.launch", *probe], "interval": 30 * 10**9,
                     "timeout": 10 * 10**9, "retries": 3, "start_period": 1800 * 10**9},
        api_url=f"http://{url_host}:{port}", needs_api_key=key, key_file=head.key_file)


def build_deployment(s: Settings, *, profile: str, snapshot: str, hf_cache: str, state_dir: str) -> Deployment:
    lay = layout_mod.parse(s["PARALLEL"])
    mode = lay.name
    nodes, addrs, gpus = boxes(s)
    out: list[Node] = []
    warnings: list[str] = []
    pd = lay.kind == "pd"
    ports = pd_ports(s, lay.boxes) if pd else None
    key = pd_key(s, addrs) if pd else None
    for i, (box, addr) in enumerate(zip(nodes, addrs)):
        role, flags = rank_args(s, lay, i, addrs)
        serves_api = role in ("head", "prefill", "decode")
        # pd: each server listens on its fast-link address, where the router on box 0 reaches it
        spec = build(s, profile=profile, snapshot=snapshot, hf_cache=hf_cache, state_dir=state_dir,
                     parallel=flags, port=ports[i] if ports else None, bind=addr if ports else None, api_key=key)
        env = {**spec.env, **node_env(s, lay, i, addr), **extra_env(s["CONTAINER_ENV"])}  # the user's word last
        labels = {**spec.labels,
                  f"{LABEL}.parallel": mode, f"{LABEL}.node": str(i), f"{LABEL}.role": role,
                  f"{LABEL}.nodes": s["NODES"], f"{LABEL}.node-addrs": s["NODE_ADDRS"]}
        changes: dict = {"name": s["NAME"] if i == 0 else f"{s['NAME']}-node{i}", "env": dict(sorted(env.items())),
                         "labels": labels, "gpu_ids": list(gpus[i]) if spec.gpus else []}
        if s["RDMA"]:
            changes.update(devices=[RDMA_DEVICE], cap_add=["IPC_LOCK"], ulimits=[("memlock", -1, -1)])
        if not serves_api:  # a headless rank: no API, no key, no /health to probe
            changes.update(healthcheck={"test": ["NONE"]}, needs_api_key=False, key_file="",
                           mounts=[m for m in spec.mounts if m.target != KEY_TARGET])
            changes["env"].pop("FLASH_API_KEY_FILE", None)
            labels[f"{LABEL}.api-key"] = "none"
        out.append(Node(i, box, engine_url(box), addr, role, list(gpus[i]), serves_api,
                        dataclasses.replace(spec, **changes)))
        warnings += [w for w in spec.warnings if w not in warnings]
    if not s["RDMA"]:
        warnings.append("RDMA=0: no /dev/infiniband, IPC_LOCK or memlock in the containers; NCCL will use TCP "
                        "sockets (about half the link's speed)")
    if lay.pp > 2 and s["MTP"]:
        warnings.append(f"PARALLEL={mode}: whether vLLM's MTP drafter (MTP={s['MTP']}) and patch 1's hoisted PLE "
                        "gather run under pipeline parallel above 2 is not established (docs/MULTINODE.md); "
                        "MTP=0 is the conservative choice")
    router = None
    if pd:
        head = out[0]
        spec = router_spec(s, out, profile=profile, state_dir=state_dir, key=key)
        exposed = open_api(s["BIND"], s["PORT"], s["API_KEY"])  # the one check single-box serve makes too
        if exposed:
            warnings.append(f"the P/D router: {exposed}")
        router = Node(len(out), head.box, head.engine, head.addr, "router", [], True, spec)
        for d in out[1:]:
            if key and d.engine and not (d.engine.startswith("unix://") or "127.0.0.1" in d.engine):
                warnings.append(f"pd: the decode server on {d.box} needs the API key file at {d.spec.key_file} "
                                "on that box (copy it there once; flash writes it only on this machine)")
    return Deployment(s["NAME"], mode, out, warnings, router)
