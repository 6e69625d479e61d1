"""Pipeline parallelism's pure rules (distributed/pipeline.py): each stage's layers, where a global rank sits in
the pp x tp grid and which ranks a node runs, which checkpoint tensors a stage loads, and the refusals."""
from __future__ import annotations

import argparse

import pytest
import torch

from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.distributed.pipeline import (check_pipeline_model, micro_batch_rows, node_ranks, rank_place,
                                              stage_group_ranks, stage_layers)
from vllm_neuron.model.layers.attention import AttentionMetadata, decode_mask
from vllm_neuron.model.pipeline_stage import decode_rows_meta, stage_holds_tensor


@pytest.mark.parametrize("layers, pp, expected", [
    (4, 2, [(0, 2), (2, 4)]),
    (3, 2, [(0, 2), (2, 3)]),  # the earlier stage takes the extra layer
    (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
    (5, 5, [(i, i + 1) for i in range(5)]),
    (7, 1, [(0, 7)]),
])
def test_stage_layers_cover_every_layer_once_in_order(layers, pp, expected):
    stages = [stage_layers(layers, pp, r) for r in range(pp)]
    assert [(s.start, s.stop) for s in stages] == expected
    assert [i for s in stages for i in s.layers] == list(range(layers))
    assert stages[0].is_first and stages[-1].is_last
    assert sum(s.is_first or s.is_last for s in stages[1:-1]) == 0


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 is larger than the model's number of decoder "
                                         r"layers \(2\).*at most 2"):
        stage_layers(2, 3, 0)


@pytest.mark.parametrize("arch", ["GemmaForCausalLM", "Qwen3MoeForCausalLM", "MistralForCausalLM", None])
def test_architectures_without_stages_are_refused(arch):
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported yet by vllm-neuron for .*"
                                         "LlamaForCausalLM, Qwen3ForCausalLM"):
        check_pipeline_model(2, [arch] if arch else None, 8)
    check_pipeline_model(1, [arch] if arch else None, 8)  # one stage: every model


def test_llama_and_qwen3_split_but_not_into_more_stages_than_layers():
    check_pipeline_model(2, ["Qwen3ForCausalLM"], 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 is larger"):
        check_pipeline_model(4, ["LlamaForCausalLM"], 3)


def test_rank_places_stage_major():
    """pp=2 x tp=2: ranks 0, 1 are stage 0 and send to 2, 3 (same tp_rank); the last stage's logits go back
    along the same column."""
    places = [rank_place(r, tp_size=2, pp_size=2) for r in range(4)]
    assert [(p.pp_rank, p.tp_rank) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.next_rank for p in places] == [2, 3, None, None]
    assert [p.prev_rank for p in places] == [None, None, 0, 1]
    assert [p.last_stage_rank for p in places] == [2, 3, 2, 3]
    assert places[1].column == [1, 3] and places[0].world == 4
    assert stage_group_ranks(2, 2) == [[0, 1], [2, 3]]
    assert [rank_place(r, 1, 3).next_rank for r in range(3)] == [1, 2, None]
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4 ranks"):
        rank_place(4, 2, 2)


def test_parallel_info_keeps_rank_and_world_inside_the_stage():
    """The model's splits read rank / world: they must be the stage's tensor-parallel place, not the global one."""
    info = ps.ParallelInfo(rank=1, world=2, pp_rank=1, pp_size=2)
    assert info.global_rank == 3
    assert info.place().next_rank is None and info.place().prev_rank == 1
    assert info.stage(5).layers == range(3, 5)


@pytest.mark.parametrize("world, nnodes, node, expected", [
    (4, 2, 0, range(0, 2)), (4, 2, 1, range(2, 4)), (6, 3, 2, range(4, 6)), (4, 1, 0, range(0, 4)),
])
def test_node_ranks(world, nnodes, node, expected):
    assert node_ranks(node, world, nnodes) == expected


def test_node_ranks_refuse_an_uneven_split():
    with pytest.raises(ValueError, match="nnodes=3 must divide the world of 4 ranks"):
        node_ranks(0, 4, 3)


def test_world_size_counts_both_dimensions_and_nnodes_must_divide_it():
    args = EngineArgs.from_kwargs(pipeline_parallel_size=2, tensor_parallel_size=2, nnodes=4)
    assert (args.world_size, args.local_tp_ranks) == (4, 1)
    assert EngineArgs.from_kwargs(pipeline_parallel_size=2, nnodes=2).local_tp_ranks == 1
    with pytest.raises(ValueError, match=r"nnodes must be a positive integer that divides tensor_parallel_size=1 x "
                                         r"pipeline_parallel_size=2 = 2 ranks"):
        EngineArgs.from_kwargs(pipeline_parallel_size=2, nnodes=4)


@pytest.mark.parametrize("kwargs, match", [
    ({"data_parallel_size": 2}, "with data_parallel_size=2"),
    ({"enable_lora": True}, "with enable_lora=True"),
    ({"enable_prompt_embeds": True}, "with enable_prompt_embeds=True"),
    ({"kv_offloading_size": 1}, "with kv_offloading_size"),
    ({"kv_transfer_config": {"kv_connector": "TcpConnector", "kv_role": "kv_both"}}, "with kv_transfer_config"),
])
def test_features_a_pipeline_cannot_serve_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=f"pipeline_parallel_size=2 is not supported yet by vllm-neuron {match}"):
        EngineArgs.from_kwargs(pipeline_parallel_size=2, **kwargs).checked(__import__("torch").device("cpu"))


@pytest.mark.parametrize("name, stage, tied, held", [
    ("model.layers.1.self_attn.q_proj.weight", 0, False, True),
    ("model.layers.2.mlp.down_proj.weight", 0, False, False),
    ("model.layers.2.mlp.down_proj.weight", 1, False, True),
    ("model.embed_tokens.weight", 0, False, True),
    ("model.embed_tokens.weight", 1, False, False),
    ("model.embed_tokens.weight", 1, True, True),  # tied: the last stage's LM head is the embedding
    ("lm_head.weight", 0, False, False),
    ("lm_head.weight", 1, False, True),
    ("model.norm.weight", 0, False, True),
])
def test_a_stage_loads_only_its_own_tensors(name, stage, tied, held):
    assert stage_holds_tensor(stage_layers(4, 2, stage), name, tied) is held


def test_cli_takes_pp():
    from vllm_neuron.config.arg_utils import add_engine_args, engine_args_from_cli

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = engine_args_from_cli(p.parse_args(["-pp", "2", "-tp", "2"]))
    assert (args.pipeline_parallel_size, args.world_size) == (2, 4)


@pytest.mark.parametrize("rows, m, expected", [
    (4, 2, [(0, 2), (2, 4)]), (5, 2, [(0, 3), (3, 5)]), (1, 2, [(0, 1)]), (6, 3, [(0, 2), (2, 4), (4, 6)]),
    (8, 1, [(0, 8)]),
])
def test_micro_batches_split_the_rows_in_order(rows, m, expected):
    assert micro_batch_rows(rows, m) == expected


def test_a_micro_batch_gets_its_rows_of_the_decode_metadata():
    positions = torch.tensor([5, 9, 2, 30])
    tables = torch.arange(16).view(4, 4)
    meta = AttentionMetadata(positions * 10, decode_mask(positions + 1, 64), block_tables=tables, is_decode=True,
                             positions=positions, query_start=torch.arange(5))
    part = decode_rows_meta(meta, 2, 4)
    assert part.slot_mapping.tolist() == [20, 300] and part.positions.tolist() == [2, 30]
    assert torch.equal(part.block_tables, tables[2:]) and torch.equal(part.mask, meta.mask[2:])
    assert part.query_start.tolist() == [0, 1, 2]  # its own rows, from 0
