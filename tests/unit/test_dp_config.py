"""Data-parallel options: vLLM's flags reach EngineConfig, and what cannot be honoured is refused
where it enters (EngineConfig, or `serve` for the head / --headless roles)."""
from __future__ import annotations

import pytest

from vllm_neuron.config.arg_utils import engine_config_from_args
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.entrypoints.cli.main import _parser
from vllm_neuron.entrypoints.cli.serve import run_serve


def test_flags_reach_the_config():
    args = _parser().parse_args(["serve", "m", "-dp", "4", "--data-parallel-size-local", "2",
                                 "--data-parallel-start-rank", "2", "--data-parallel-address", "10.0.0.1",
                                 "--data-parallel-rpc-port", "13345", "--headless"])
    cfg = engine_config_from_args(args)
    assert (cfg.data_parallel_size, cfg.local_dp_replicas, cfg.data_parallel_start_rank, cfg.data_parallel_address,
            cfg.data_parallel_rpc_port, cfg.multi_node_dp, args.headless) == (4, 2, 2, "10.0.0.1", 13345, True, True)
    single = EngineConfig.from_kwargs(data_parallel_size=2)
    assert single.local_dp_replicas == 2 and not single.multi_node_dp


@pytest.mark.parametrize("kwargs, match", [
    (dict(data_parallel_size=0), "data_parallel_size must be a positive integer"),
    (dict(data_parallel_size=2, data_parallel_size_local=3), r"data_parallel_size_local must be an integer in \[0"),
    (dict(data_parallel_size=2, data_parallel_start_rank=2), r"data_parallel_start_rank must be an integer in \[0"),
    (dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=3), "exceeds data_parallel_size=4"),
    (dict(data_parallel_size=2, data_parallel_rpc_port=70000), "data_parallel_rpc_port must be a TCP port"),
    (dict(data_parallel_size=2, data_parallel_address=""), "data_parallel_address must be"),
    (dict(data_parallel_size=2, data_parallel_rank=1), "data_parallel_rank=1 is not supported yet"),
    (dict(data_parallel_size=2, data_parallel_backend="ray"), "data_parallel_backend='ray' is not supported yet"),
    (dict(data_parallel_size=2, data_parallel_hybrid_lb=True), "data_parallel_hybrid_lb=True is not supported yet"),
])
def test_invalid_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


@pytest.mark.parametrize("argv, match", [
    (["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1"],
     "--data-parallel-start-rank 1 is for --headless nodes"),
    (["--headless"], "--headless runs some of the replicas"),
    (["--headless", "-dp", "2"], "--headless runs some of the replicas"),
    (["--headless", "-dp", "2", "--data-parallel-size-local", "0"], "needs --data-parallel-size-local >= 1"),
])
def test_serve_roles_are_checked_before_anything_starts(argv, match):
    with pytest.raises(ValueError, match=match):
        run_serve(_parser().parse_args(["serve", "m", *argv]))


def test_validate_logits_refuses_data_parallelism():
    from vllm_neuron.entrypoints.cli.validate_logits import run_validate_logits

    with pytest.raises(ValueError, match="--data-parallel-size must be 1, got 2"):
        run_validate_logits(_parser().parse_args(["validate-logits", "-dp", "2"]))


def test_placement_sets_the_replicas_memory_share():
    from vllm_neuron.engine.replica import ReplicaPlacement, placement_config

    cpu = EngineConfig.from_kwargs(data_parallel_size=2)
    placement_config(cpu, ReplicaPlacement(1, 1, None, 2))
    assert (cpu.kv_budget_shared_by, cpu.gpu_memory_utilization) == (2, 0.9)
    gpu = EngineConfig.from_kwargs(data_parallel_size=2)
    placement_config(gpu, ReplicaPlacement(1, None, 0, 2))  # two replicas on one GPU
    assert gpu.gpu_memory_utilization == pytest.approx(0.45)
