"""Data-parallel options: vLLM's flags reach EngineArgs, what cannot be honoured is refused where it enters
(EngineArgs, or `serve` for the head / --headless roles), and each replica's memory share is resolved."""
from __future__ import annotations

import pytest

from vllm_neuron.config.arg_utils import engine_args_from_cli
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import ModelFacts, resolve
from vllm_neuron.entrypoints.cli.main import _parser
from vllm_neuron.entrypoints.cli.serve import run_serve


def test_flags_reach_the_config():
    args = _parser().parse_args(["serve", "m", "-dp", "4", "--data-parallel-size-local", "2",
                                 "--data-parallel-start-rank", "2", "--data-parallel-address", "10.0.0.1",
                                 "--data-parallel-rpc-port", "13345", "--headless"])
    cfg = engine_args_from_cli(args)
    assert (cfg.data_parallel_size, cfg.local_dp_replicas, cfg.data_parallel_start_rank, cfg.data_parallel_address,
            cfg.data_parallel_rpc_port, cfg.multi_node_dp, args.headless) == (4, 2, 2, "10.0.0.1", 13345, True, True)
    single = EngineArgs.from_kwargs(data_parallel_size=2)
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
        EngineArgs.from_kwargs(**kwargs)


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


@pytest.mark.parametrize("gpus, local, shared_by, gmu", [(None, None, 2, 0.9), (1, None, 2, 0.45), (2, None, 1, 0.9),
                                                        (1, 1, 1, 0.9)])
def test_each_replicas_memory_share_is_resolved_with_the_config(monkeypatch, gpus, local, shared_by, gmu):
    """Replicas on one host share its RAM (CPU: the KV budget splits by local workers) or a GPU (CUDA: the
    replicas sharing the most loaded GPU split its gpu_memory_utilization); the resolved config holds the
    share, so no replica process changes it. gpus None: the CPU."""
    import torch

    from vllm_neuron.config import engine_config
    from vllm_neuron.engine.replica import plan_placements

    if gpus is not None:
        monkeypatch.setattr(engine_config, "resolve_device", lambda d: torch.device("cuda"))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cfg = resolve(EngineArgs.from_kwargs(data_parallel_size=2, data_parallel_size_local=local,
                                         data_parallel_address="10.0.0.1"), ModelFacts(2048))
    assert (cfg.kv_budget_shared_by, cfg.gpu_memory_utilization) == (shared_by, pytest.approx(gmu))
    # The placements of the host's replicas say the same.
    placements = plan_placements(range(cfg.local_dp_replicas), on_cuda=gpus is not None, cuda_count=gpus or 0,
                                 cpu_threads=4)
    assert {p.kv_budget_shared_by for p in placements} == {shared_by}
