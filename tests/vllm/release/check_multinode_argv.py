"""Issue 15: every box's `vllm serve` argv that flash renders for tp2 / pp2 / dp2 / pd is accepted
by this release's own `vllm serve` parser (the CLI's real subcommand, --headless included) and
means what multinode.py says it means: the parsed ranks, addresses, sizes and KV-transfer config,
and vLLM's own ParallelConfig puts a tp2/pp2 worker on the headless-executor path
(node_rank_within_dp > 0) and a dp2 worker on the data-parallel engine path (== 0)."""

from __future__ import annotations

import json

import pytest

from flash_cli import multinode, profiles
from flash_cli.settings import resolve

ADDRS = "10.0.0.1,10.0.0.2"


@pytest.fixture(scope="module")
def serve_parser():
    """`vllm serve`'s own parser: the `make_arg_parser` its subcommand calls (model_tag, --headless,
    every engine flag) and the `validate_parsed_serve_args` it runs. (The subcommand module itself
    imports uvicorn, which these CPU environments do not carry.) It moved between releases."""
    import importlib

    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for where in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"):
        try:
            cli_args = importlib.import_module(where)
            break
        except ModuleNotFoundError:
            continue
    else:
        pytest.fail("no vllm serve argument parser module in this release")
    with pytest.MonkeyPatch.context() as mp:  # the CLI builds config defaults: needs a device type
        mp.setattr(type(current_platform), "device_type", "cpu", raising=False)
        yield cli_args.make_arg_parser(FlexibleArgumentParser(prog="vllm serve")), cli_args.validate_parsed_serve_args


@pytest.fixture(scope="module")
def boxes(base):
    """Each box of a mode, rendered for the base of the release installed here."""
    def render(mode: str):
        name = mode if mode in profiles.names() else "tp2"
        p = profiles.load(name)
        s = resolve(p.layer(), {}, {"PARALLEL": mode, "NODES": "a,b", "NODE_ADDRS": ADDRS, "BASE": base},
                    profile_name=name)
        return multinode.build_deployment(s, profile=name, snapshot="0" * 40, hf_cache="/hf-host",
                                          state_dir="/st").nodes
    return render


def parse(serve_parser, argv):
    parser, validate = serve_parser
    assert argv[:2] == ["vllm", "serve"]
    args = parser.parse_args(argv[2:])
    validate(args)
    assert args.model_tag == argv[2]
    return args


@pytest.mark.parametrize("mode", ["tp2", "pp2"])
def test_tp_pp_ranks(serve_parser, boxes, mode):
    from vllm.config import ParallelConfig

    for node in boxes(mode):
        a = parse(serve_parser, node.spec.command)
        size = a.tensor_parallel_size if mode == "tp2" else a.pipeline_parallel_size
        assert (size, a.nnodes, a.node_rank, a.master_addr, a.master_port) == (2, 2, node.index, "10.0.0.1", 29501)
        assert a.headless is (node.index == 1)
        pc = ParallelConfig(tensor_parallel_size=a.tensor_parallel_size, pipeline_parallel_size=a.pipeline_parallel_size,
                            nnodes=a.nnodes, node_rank=a.node_rank, master_addr=a.master_addr,
                            distributed_executor_backend="mp")
        # serve.run_headless takes the multi-node executor path exactly when node_rank_within_dp > 0
        assert pc.nnodes_within_dp == 2 and pc.node_rank_within_dp == node.index
        assert pc.world_size == 2


def test_dp_ranks(serve_parser, boxes):
    from vllm.config import ParallelConfig

    for node in boxes("dp2"):
        a = parse(serve_parser, node.spec.command)
        assert (a.data_parallel_size, a.data_parallel_size_local, a.data_parallel_address, a.data_parallel_rpc_port) \
            == (2, 1, "10.0.0.1", 29550)
        assert a.headless is (node.index == 1)
        assert a.data_parallel_start_rank == (1 if node.index else None)
        assert a.nnodes == 1 and a.tensor_parallel_size == 1
        assert not a.data_parallel_hybrid_lb and not a.data_parallel_external_lb
        pc = ParallelConfig(data_parallel_size=2, data_parallel_size_local=1, data_parallel_rank=node.index,
                            data_parallel_master_ip=a.data_parallel_address,
                            data_parallel_rpc_port=a.data_parallel_rpc_port, distributed_executor_backend="mp")
        assert pc.node_rank_within_dp == 0  # the headless worker runs DP engines, not a TP executor
        assert pc.world_size == 1 and pc.world_size_across_dp == 2


def test_pd_kv_transfer_config(serve_parser, boxes):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    roles = []
    for node in boxes("pd"):
        a = parse(serve_parser, node.spec.command)
        cfg = a.kv_transfer_config
        cfg = cfg if isinstance(cfg, KVTransferConfig) else KVTransferConfig(**json.loads(cfg) if isinstance(cfg, str) else cfg)
        assert cfg.kv_connector == multinode.NIXL_CONNECTOR
        assert cfg.kv_connector in KVConnectorFactory._registry
        roles.append((cfg.is_kv_producer, cfg.is_kv_consumer))
        assert a.headless is False
    assert roles == [(True, False), (False, True)]  # never the deprecated kv_both
