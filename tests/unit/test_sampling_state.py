"""Which rows the graph samples and which the host samples, and seeded determinism across batches."""
from __future__ import annotations

import logging

import torch

from vllm_neuron.config.neuron_config import OnDeviceSamplingConfig
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.step import NewRequestData
from vllm_neuron.worker.sampling_state import SamplingStates


def _states(odsc=OnDeviceSamplingConfig(), **params) -> SamplingStates:
    st = SamplingStates(odsc, seed=0)
    st.add(NewRequestData("r", [1, 2, 3], SamplingParams(**params), eos_token_id=2))
    return st


def test_in_graph_rows_and_host_rows():
    assert not _states(temperature=0.7, top_k=50).states["r"].on_host
    assert _states(temperature=0.7, min_p=0.1).states["r"].on_host
    assert _states(temperature=0.0, logprobs=2).states["r"].on_host
    assert _states(OnDeviceSamplingConfig(top_k=64), temperature=0.7, top_k=100).states["r"].on_host
    assert _states(None, temperature=0.7).states["r"].on_host  # CPU sampling: every row


def test_top_p_with_top_k_off_is_said_once_at_start_not_warned_per_request(caplog):
    """The bundled model's own default (top_p 0.9, top_k off) must not put a WARNING on a user's first request:
    the in-graph cap on top-p's tokens is one INFO line when the engine starts."""
    with caplog.at_level(logging.INFO, logger="vllm_neuron"):
        st = _states(temperature=0.7, top_k=-1)
        _states(temperature=0.5, top_k=0, top_p=0.9)
        _states(temperature=0.5, top_k=-1, top_p=0.8)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    starts = [r.getMessage() for r in caplog.records if "most likely tokens" in r.getMessage()]
    assert len(starts) == 3 and all("top_p with top_k off included" in m for m in starts)  # one per engine
    t = st.graph_tensors(["r"], rows=2)
    assert t["top_k"][0] == 0 and t["temperature"][1] == 0.0  # padded row is greedy


def test_seeded_uniforms_do_not_depend_on_neighbours():
    def draws(with_neighbour: bool) -> list[float]:
        st = SamplingStates(OnDeviceSamplingConfig(), seed=0)
        st.add(NewRequestData("s", [1], SamplingParams(temperature=1.0, seed=7), 2))
        ids = ["s"]
        if with_neighbour:
            st.add(NewRequestData("u", [1], SamplingParams(temperature=1.0), 2))
            ids = ["u", "s"]
        out = []
        for _ in range(3):
            out.append(float(st.graph_tensors(ids, rows=4)["uniform"][ids.index("s")]))
        return out

    assert draws(False) == draws(True)


def test_finalize_mixes_graph_and_host_tokens():
    st = SamplingStates(OnDeviceSamplingConfig(), seed=0)
    st.add(NewRequestData("g", [1], SamplingParams(temperature=0.0), 2))
    st.add(NewRequestData("h", [1], SamplingParams(temperature=0.0, logit_bias={5: 100.0}), 2))
    logits = torch.zeros(2, 10)
    logits[:, 3] = 1.0
    sampled, logprobs = st.finalize(["g", "h"], torch.tensor([3, 3]), logits)
    assert sampled == {"g": [3], "h": [5]}  # the host row applied its logit bias
    assert st.states["h"].output_token_ids == [5]


def test_finalize_reads_each_request_at_its_own_row_and_gathers_only_host_rows():
    """Padded batches: request i sits at row rows[i] of the graph's tokens and logits; the logits are
    indexed for the host rows alone (the graph's rows never copy the [B, V] tensor)."""
    st = SamplingStates(OnDeviceSamplingConfig(), seed=0)
    st.add(NewRequestData("g", [1], SamplingParams(temperature=0.0), 2))
    st.add(NewRequestData("h", [1], SamplingParams(temperature=0.0, logit_bias={7: 100.0}), 2))
    logits = torch.zeros(4, 10)
    logits[3, 6] = 200.0  # row 3 is h's: its argmax beats the bias of token 7
    seen = []

    class Spy(torch.Tensor):
        def __getitem__(self, idx):
            seen.append(idx)
            return torch.Tensor.__getitem__(self.as_subclass(torch.Tensor), idx)

    sampled, _ = st.finalize(["g", "h"], torch.tensor([9, 8, 4, 1]), logits.as_subclass(Spy), rows=[1, 3])
    assert sampled == {"g": [8], "h": [6]}
    assert seen == [[3]]
    sampled, _ = st.finalize(["g"], torch.tensor([9, 8, 4, 1]), logits.as_subclass(Spy), rows=[2])
    assert sampled == {"g": [4]} and seen == [[3]]


def test_a_token_draws_the_same_number_on_every_path_and_after_preemption():
    """The number is counter_uniform(seed, position): the same for the graph's rows and the host's, and
    drawn again, not advanced, when preemption drops a token and the request samples it anew."""
    from vllm_neuron.model.layers.in_graph_sampler import counter_uniform, fold_seed

    graph_row = SamplingStates(OnDeviceSamplingConfig(), seed=0)
    graph_row.add(NewRequestData("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=42), 2))
    host_row = SamplingStates(OnDeviceSamplingConfig(), seed=5)
    host_row.add(NewRequestData("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=42, logprobs=1), 2))
    assert not graph_row.states["r"].on_host and host_row.states["r"].on_host
    expected = float(counter_uniform(torch.tensor([fold_seed(42)]), torch.tensor([3])))
    assert float(graph_row.graph_tensors(["r"], rows=1)["uniform"][0]) == expected
    assert float(host_row.uniforms(["r"])[0]) == expected
    logits = torch.randn(1, 50)
    first = graph_row.finalize(["r"], torch.tensor([7]), logits)[0]["r"]
    after = float(graph_row.graph_tensors(["r"], rows=1)["uniform"][0])
    graph_row.truncate("r", 0)  # preempted with that token in flight
    assert float(graph_row.graph_tensors(["r"], rows=1)["uniform"][0]) == expected != after
    assert first == [7]
