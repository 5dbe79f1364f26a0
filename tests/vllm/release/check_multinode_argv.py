"""Issues 15, 35: every box's `vllm serve` argv that flash renders for each PARALLEL layout (tpN,
tpNep, ppN, tp2pp2, dpN, pd, pdN: 2 to 4 boxes) is accepted by this release's own `vllm serve`
parser (the CLI's real subcommand, --headless included) and means what multinode.py says it means:
the parsed ranks, addresses, sizes, expert parallel and KV-transfer config, and vLLM's own
ParallelConfig puts a tp/pp worker on the headless-executor path (node_rank_within_dp > 0) with the
world size of the layout, and a dp worker on the data-parallel engine path (== 0)."""

from __future__ import annotations

import json

import pytest

from flash_cli import layout, multinode, profiles
from flash_cli.settings import resolve

RENDEZVOUS = [n for n in layout.ACCEPTED if layout.parse(n).rendezvous]
DP = [n for n in layout.ACCEPTED if layout.parse(n).kind == "dp"]
PD = [n for n in layout.ACCEPTED if layout.parse(n).kind == "pd"]


@pytest.fixture(scope="module")
def boxes(base):
    """Each box of a mode, rendered for the base of the release installed here."""
    def render(mode: str):
        name = mode if mode in profiles.names() else "tp2"
        p = profiles.load(name)
        n = layout.parse(mode).boxes
        s = resolve(p.layer(), {}, {"PARALLEL": mode, "NODES": ",".join("abcd"[:n]),
                                    "NODE_ADDRS": ",".join(f"10.0.0.{i + 1}" for i in range(n)), "BASE": base},
                    profile_name=name)
        return multinode.build_deployment(s, profile=name, snapshot="0" * 40, hf_cache="/hf-host",
                                          state_dir="/st").nodes
    return render


def parse(serve_cli, argv):
    assert argv[:2] == ["vllm", "serve"]
    args = serve_cli.parser.parse_args(argv[2:])
    serve_cli.validate(args)
    assert args.model_tag == argv[2]
    return args


@pytest.mark.parametrize("mode", RENDEZVOUS)
def test_tp_pp_ranks(serve_cli, boxes, mode):
    from vllm.config import ParallelConfig

    lay = layout.parse(mode)
    nodes = boxes(mode)
    assert len(nodes) == lay.boxes
    for node in nodes:
        a = parse(serve_cli, node.spec.command)
        assert (a.tensor_parallel_size, a.pipeline_parallel_size) == (lay.tp, lay.pp)
        assert (a.nnodes, a.node_rank, a.master_addr, a.master_port) == (lay.boxes, node.index, "10.0.0.1", 29501)
        assert bool(a.enable_expert_parallel) is lay.ep
        assert a.headless is (node.index > 0)
        pc = ParallelConfig(tensor_parallel_size=a.tensor_parallel_size, pipeline_parallel_size=a.pipeline_parallel_size,
                            nnodes=a.nnodes, node_rank=a.node_rank, master_addr=a.master_addr,
                            enable_expert_parallel=a.enable_expert_parallel, distributed_executor_backend="mp")
        # serve.run_headless takes the multi-node executor path exactly when node_rank_within_dp > 0
        assert pc.nnodes_within_dp == lay.boxes and pc.node_rank_within_dp == node.index
        assert pc.world_size == lay.tp * lay.pp == lay.boxes


@pytest.mark.parametrize("mode", DP)
def test_dp_ranks(serve_cli, boxes, mode):
    from vllm.config import ParallelConfig

    n = layout.parse(mode).boxes
    nodes = boxes(mode)
    assert len(nodes) == n
    for node in nodes:
        a = parse(serve_cli, node.spec.command)
        assert (a.data_parallel_size, a.data_parallel_size_local, a.data_parallel_address, a.data_parallel_rpc_port) \
            == (n, 1, "10.0.0.1", 29550)
        assert a.headless is (node.index > 0)
        assert a.data_parallel_start_rank == (node.index if node.index else None)
        assert a.nnodes == 1 and a.tensor_parallel_size == 1
        assert not a.data_parallel_hybrid_lb and not a.data_parallel_external_lb
        pc = ParallelConfig(data_parallel_size=n, data_parallel_size_local=1, data_parallel_rank=node.index,
                            data_parallel_master_ip=a.data_parallel_address,
                            data_parallel_rpc_port=a.data_parallel_rpc_port, distributed_executor_backend="mp")
        assert pc.node_rank_within_dp == 0  # a headless worker runs DP engines, not a TP executor
        assert pc.world_size == 1 and pc.world_size_across_dp == n


@pytest.mark.parametrize("mode", PD)
def test_pd_kv_transfer_config(serve_cli, boxes, mode):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    n = layout.parse(mode).boxes
    roles = []
    for node in boxes(mode):
        a = parse(serve_cli, node.spec.command)
        cfg = a.kv_transfer_config
        cfg = cfg if isinstance(cfg, KVTransferConfig) else KVTransferConfig(**json.loads(cfg) if isinstance(cfg, str) else cfg)
        assert cfg.kv_connector == multinode.NIXL_CONNECTOR
        assert cfg.kv_connector in KVConnectorFactory._registry
        roles.append((cfg.is_kv_producer, cfg.is_kv_consumer))
        assert a.headless is False
        assert (a.host, a.port) == (f"10.0.0.{node.index + 1}", 18310 + node.index)
    assert roles == [(True, False)] + [(False, True)] * (n - 1)  # never the deprecated kv_both



MULTI_PROFILES = [n for n in profiles.names() if profiles.load(n).values.get("PARALLEL", "none") != "none"]


def test_the_multi_box_profiles_on_this_base_parse(serve_cli, base):
    """Each multi-box profile as shipped (NVIDIA's two-Spark settings included: their flags are the
    profile's, not only the layout's), on the release its base names: the profiles whose base is
    this release's (all of them on the current base; none on older releases, which the layout
    checks above cover)."""
    from flash_common import releases

    checked = []
    for profile in MULTI_PROFILES:
        p = profiles.load(profile)
        n = layout.parse(p.values["PARALLEL"]).boxes
        s = resolve(p.layer(), {}, {"NODES": ",".join("abcd"[:n]),
                                    "NODE_ADDRS": ",".join(f"10.0.0.{i + 1}" for i in range(n))}, profile_name=profile)
        if s["BASE"] != base:
            continue
        nodes = multinode.build_deployment(s, profile=profile, snapshot="0" * 40, hf_cache="/hf-host",
                                           state_dir="/st").nodes
        assert len(nodes) == n, profile
        for node in nodes:
            a = parse(serve_cli, node.spec.command)
            # the profile's own settings reach vLLM's parser as the profile means them
            assert (a.max_num_seqs, a.max_model_len) == (int(s["SEQS"]), int(s["CTX"])), profile
            spec = a.speculative_config
            spec = json.loads(spec) if isinstance(spec, str) else spec
            assert spec["num_speculative_tokens"] == int(s["MTP"]), profile
        checked.append(profile)
    if base == releases.CURRENT:
        assert set(checked) == set(MULTI_PROFILES)
