"""Tensor / expert parallelism without processes: the splitting rules, a rank's shard of the weights as
loaded, the thread split, and the configuration rules (the seeds' EP rules, multi-node flags)."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_model, tiny_config
from vllm_neuron.config.arg_utils import engine_args_from_cli
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.model.layers.parallel import shard_tensor


@pytest.fixture
def rank_info():
    """Sets this process's parallel place for building a shard; restored afterwards."""
    yield ps.set_info
    ps.set_info(ps.ParallelInfo())


def test_kv_heads_split_or_replicated():
    assert ps.local_kv_heads(8, 2) == 4
    assert ps.local_kv_heads(2, 2) == 1
    assert ps.local_kv_heads(2, 4) == 1  # more ranks than KV heads: one head each, replicated
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the number of KV heads \(3\)"):
        ps.local_kv_heads(3, 2)
    with pytest.raises(ValueError, match="larger than the number of KV heads"):
        ps.local_kv_heads(2, 3)
    # Replicated heads go to consecutive ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1.
    assert [ps.piece_index(2, 1, r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [ps.piece_index(8, 2, r, 4) for r in range(4)] == [0, 1, 2, 3]


def test_threads_split_between_ranks():
    assert ps.threads_per_rank(2, cores=2) == 1
    assert ps.threads_per_rank(1, cores=2) == 2
    assert ps.threads_per_rank(4, cores=2) == 1  # never zero
    assert ps.threads_per_rank(2, cores=16) == 8


def test_shard_tensor_pads_the_vocabulary(rank_info):
    full = torch.arange(10.0).reshape(5, 2)  # 5 rows over 2 ranks: 3 + 3, the last padded with zeros
    rank_info(ps.ParallelInfo(1, 2))
    assert shard_tensor(full, (3, 2)).tolist() == [[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]
    rank_info(ps.ParallelInfo(0, 2))
    assert shard_tensor(full, (3, 2)).tolist() == full[:3].tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_llama_shards_hold_their_heads(world, rank_info, tmp_path):
    """Each rank's loaded q/k/v rows, o_proj columns, MLP slices and vocabulary rows are its own piece of
    the checkpoint's tensors; at 4 ranks (2 KV heads) each KV head sits on two consecutive ranks."""
    from vllm_neuron.model.llama.model import LlamaForCausalLM

    hf = build_tiny_model("llama")  # 4 query heads, 2 KV heads, head_dim 16, intermediate 128
    sd = {k: v for k, v in hf.state_dict().items()}
    d, inter, vocab = 16, 128, hf.config.vocab_size
    for rank in range(world):
        rank_info(ps.ParallelInfo(rank, world))
        m = LlamaForCausalLM(hf.config)
        m.load_weights(iter(sd.items()))
        attn = m.model.layers[0].self_attn
        q_heads, kv_heads = 4 // world, max(1, 2 // world)
        kv_piece = rank * (2 // kv_heads) // world
        q, k, v = attn.qkv_proj.weight.split(attn.qkv_sizes)
        p = "model.layers.0."
        assert torch.equal(q, sd[p + "self_attn.q_proj.weight"][rank * q_heads * d:(rank + 1) * q_heads * d])
        kv_rows = slice(kv_piece * kv_heads * d, (kv_piece + 1) * kv_heads * d)
        assert torch.equal(k, sd[p + "self_attn.k_proj.weight"][kv_rows])
        assert torch.equal(v, sd[p + "self_attn.v_proj.weight"][kv_rows])
        assert torch.equal(attn.o_proj.weight, sd[p + "self_attn.o_proj.weight"][:, rank * q_heads * d:
                                                                                 (rank + 1) * q_heads * d])
        i = inter // world
        gate, up = m.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, sd[p + "mlp.gate_proj.weight"][rank * i:(rank + 1) * i])
        assert torch.equal(up, sd[p + "mlp.up_proj.weight"][rank * i:(rank + 1) * i])
        rows = vocab // world
        assert torch.equal(m.lm_head.weight, sd["lm_head.weight"][rank * rows:(rank + 1) * rows])
        assert torch.equal(m.model.embed_tokens.weight, sd["model.embed_tokens.weight"][rank * rows:(rank + 1) * rows])
        assert m.kv_cache_spec() == (2, kv_heads, d)


def test_qwen3_moe_expert_parallel_shards(rank_info):
    """ep_degree 2 of 2 ranks: each rank holds 4 of the 8 experts whole; ep_degree 1: all 8 experts, half
    of each one's intermediate size."""
    from vllm_neuron.model.qwen3_moe.model import Qwen3MoeForCausalLM

    hf = build_tiny_model("qwen3_moe")
    sd = dict(hf.state_dict())
    if "model.layers.0.mlp.experts.gate_up_proj" in sd:  # transformers 5 holds experts stacked
        stacked = sd["model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2I, H]
        gate_of = lambda e: stacked[e][:32]  # noqa: E731
    else:
        gate_of = lambda e: sd[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"]  # noqa: E731
    for rank in range(2):
        rank_info(ps.ParallelInfo(rank, 2, ep_degree=2))
        m = Qwen3MoeForCausalLM(hf.config)
        m.load_weights(iter(sd.items()))
        experts = m.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape == (4, 64, 64)
        for local in range(4):
            assert torch.equal(experts.gate_up_proj[local, :32], gate_of(rank * 4 + local))
        rank_info(ps.ParallelInfo(rank, 2, ep_degree=1))
        m = Qwen3MoeForCausalLM(hf.config)
        m.load_weights(iter(sd.items()))
        experts = m.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape == (8, 32, 64)
        assert torch.equal(experts.gate_up_proj[5, :16], gate_of(5)[rank * 16:(rank + 1) * 16])
    rank_info(ps.ParallelInfo(0, 2, ep_degree=2))
    with pytest.raises(ValueError, match=r"ep_degree=2 must divide the number of experts \(7\)"):
        Qwen3MoeForCausalLM(tiny_config("qwen3_moe", num_experts=7))


def _rank_models(cls, hf, rank_info, world: int, ep_degree: int = 1, **kw) -> list:
    """Each rank's shard of `hf` (loaded from its state dict), then back to one rank: the all-reduce is then
    an identity, so a layer's output on a rank is that rank's partial sum."""
    models = []
    for rank in range(world):
        rank_info(ps.ParallelInfo(rank, world, ep_degree))
        m = cls(hf.config, **kw)
        m.load_weights(iter(hf.state_dict().items()))
        models.append(m)
    rank_info(ps.ParallelInfo())
    return models


def _assert_partials_sum(full, parts, x) -> None:
    with torch.no_grad():
        torch.testing.assert_close(sum(p(x) for p in parts), full(x), rtol=1e-5, atol=1e-5)


def test_llama_biases_split_or_added_once(rank_info):
    """attention_bias / mlp_bias at 2 ranks: q/k/v and gate/up biases split with their rows, o_proj and
    down_proj biases held by rank 0 only, so the ranks' partial outputs sum to the full layer's."""
    from vllm_neuron.model.llama.model import LlamaForCausalLM

    hf = build_tiny_model("llama", attention_bias=True, mlp_bias=True)
    full = LlamaForCausalLM(hf.config)
    full.load_weights(iter(hf.state_dict().items()))
    ranks = _rank_models(LlamaForCausalLM, hf, rank_info, 2)
    x = torch.randn(5, 64)
    _assert_partials_sum(full.model.layers[0].mlp, [m.model.layers[0].mlp for m in ranks], x)
    heads_out = torch.randn(5, 64)  # the attention output of the 4 heads; each rank holds 2
    _assert_partials_sum(lambda o: full.model.layers[1].self_attn.o_proj(o),
                         [lambda o, m=m, r=r: m.model.layers[1].self_attn.o_proj(o[:, r * 32:(r + 1) * 32])
                          for r, m in enumerate(ranks)], heads_out)
    assert torch.equal(ranks[1].model.layers[0].mlp.down_proj.bias, torch.zeros(64))
    q_bias = hf.state_dict()["model.layers.0.self_attn.q_proj.bias"]
    assert torch.equal(ranks[1].model.layers[0].self_attn.qkv_proj.bias[:32], q_bias[32:])


@pytest.mark.parametrize("ep_degree", [1, 2])
def test_gpt_oss_shards_sum_to_the_full_model(ep_degree, rank_info):
    """gpt-oss at 2 ranks: each rank's sinks are its heads'; its experts (ep_degree 2: 4 whole experts,
    ep_degree 1: all 8, half of each one's interleaved gate/up and down) give partial MoE outputs that sum
    to the full layer's, for decode-sized (gathered experts) and prefill-sized (dense) batches."""
    from vllm_neuron.model.gpt_oss.model import GptOssForCausalLM

    hf = build_tiny_model("gpt_oss")
    full = GptOssForCausalLM(hf.config)
    full.load_weights(iter(hf.state_dict().items()))
    ranks = _rank_models(GptOssForCausalLM, hf, rank_info, 2, ep_degree)
    sinks = hf.state_dict()["model.layers.0.self_attn.sinks"]
    assert [m.model.layers[0].self_attn.sinks.tolist() for m in ranks] == [sinks[:2].tolist(), sinks[2:].tolist()]
    for n in (1, 12):  # 1 x top-2 <= 4 local experts: gathered; 12 tokens: every expert densely
        _assert_partials_sum(full.model.layers[1].mlp, [m.model.layers[1].mlp for m in ranks], torch.randn(n, 64))


def test_gpt_oss_mxfp4_experts_split_in_whole_blocks(rank_info):
    """MXFP4-packed experts shard by expert (ep_degree = TP) exactly; an intermediate split that cuts
    the 32-wide blocks (32 / 2 ranks) is refused naming the option."""
    from vllm_neuron.model.gpt_oss.model import GptOssForCausalLM

    hf = build_tiny_model("gpt_oss")
    full = GptOssForCausalLM(hf.config, quantization="mxfp4")
    full.load_weights(iter(hf.state_dict().items()))
    ranks = _rank_models(GptOssForCausalLM, hf, rank_info, 2, 2, quantization="mxfp4")
    assert ranks[1].model.layers[0].mlp.experts.down_proj_blocks.shape[0] == 4
    _assert_partials_sum(full.model.layers[0].mlp, [m.model.layers[0].mlp for m in ranks], torch.randn(12, 64))
    with pytest.raises(ValueError, match=r"quantization='mxfp4' .* tensor_parallel_size / ep_degree = 2 leaves "
                                         r"each rank 16"):
        _rank_models(GptOssForCausalLM, hf, rank_info, 2, 1, quantization="mxfp4")


def _cfg(**kw) -> EngineArgs:
    return EngineArgs.from_kwargs(device="cpu", **kw)


def test_seeds_expert_parallel_rules():
    nc = {"neuron_config": {"ep_degree": 2}}
    with pytest.raises(ValueError, match="^ep_degree requires --enable-expert-parallel"):
        _cfg(tensor_parallel_size=2, additional_config=nc)
    # DP with EP: ep_degree must be TP x DP (checked before anything else about DP).
    with pytest.raises(ValueError, match=r"requires ep_degree = TP x DP = 4 .*got ep_degree=2\. Other combinations "
                                         "are rejected"):
        _cfg(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True, additional_config=nc)
    with pytest.raises(ValueError, match="enable_expert_parallel=True is not supported yet"):
        _cfg(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True,
             additional_config={"neuron_config": {"ep_degree": 4}})
    with pytest.raises(ValueError, match="ep_degree=3 must divide tensor_parallel_size=2"):
        _cfg(tensor_parallel_size=2, enable_expert_parallel=True, additional_config={"neuron_config": {"ep_degree": 3}})
    # Full EP by default: ep_degree = TP.
    cfg = _cfg(tensor_parallel_size=2, enable_expert_parallel=True)
    assert cfg.additional_config.neuron_config.resolved(
        max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256, block_size=16, enable_expert_parallel=True,
        tensor_parallel_size=2).ep_degree == 2


def test_tensor_parallel_and_multi_node_flags():
    import argparse

    from vllm_neuron.config.arg_utils import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["-tp", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                              "--master-port", "30000", "--device", "cpu"])
    cfg = engine_args_from_cli(args)
    assert (cfg.tensor_parallel_size, cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == \
        (4, 2, 1, "10.0.0.1", 30000)
    assert cfg.local_tp_ranks == 2
    with pytest.raises(ValueError, match="nnodes must be a positive integer that divides tensor_parallel_size=3"):
        _cfg(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match=r"node_rank must be an integer in \[0, 1\] \(nnodes=2\), got 2"):
        _cfg(tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="master_port must be a TCP port"):
        _cfg(tensor_parallel_size=2, nnodes=2, master_port=70000)
    # DP x TP: each replica's ranks on its replica's node (replicas spread with the DP flags).
    assert _cfg(tensor_parallel_size=2, data_parallel_size=2).local_tp_ranks == 2
    with pytest.raises(ValueError, match="nnodes=2 is not supported yet by vllm-neuron: with data_parallel_size=2"):
        _cfg(tensor_parallel_size=2, nnodes=2, data_parallel_size=2)


def test_tensor_parallel_refused_where_not_built(monkeypatch):
    from vllm_neuron.config import engine_args

    monkeypatch.setattr(engine_args, "resolve_device", lambda d: torch.device("cuda"))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported yet.*CPU.*one GPU per rank"):
        EngineArgs.from_kwargs(device="cuda", tensor_parallel_size=2)
    monkeypatch.undo()
    # Speculative decoding shards with the target (tests/parity/test_tensor_parallel.py).
    EngineArgs.from_kwargs(device="cpu", tensor_parallel_size=2,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
