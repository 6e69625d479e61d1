"""CUDA graph replay logic (worker/cuda_graphs.py) with a fake capturer: static inputs filled in place,
persistent tensors read where they live, outputs cloned, one capture per bucket, mismatches refused.
The real capturer runs only on CUDA (benchmarks/gpu/s02_kernels.py checks it there)."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from vllm_neuron.worker.cuda_graphs import ReplayedGraph, wants_capture


class FakeCapturer:
    """Stands in for a CUDA graph: "capturing" records `run` (which reads the static inputs by address,
    as a graph does) without running it, and replay re-runs it into the captured output tensors."""

    def __init__(self) -> None:
        self.captures = 0
        self.first_runs = 0
        self._first = None

    def first_run(self, run):
        self.first_runs += 1
        self._first = run()
        return self._first

    def capture(self, run):
        self.captures += 1
        outs = pytree.tree_map(lambda t: torch.full_like(t, -7), self._first)  # shapes only

        def replay():
            for o, n in zip(pytree.tree_leaves(outs), pytree.tree_leaves(run())):
                o.copy_(n)
        return replay, outs


def decode_like(ids, positions, state, cache, scale):
    """A bucket graph in miniature: reads per-step inputs, updates persistent tensors in place."""
    cache.index_copy_(0, positions, ids.float()[:, None].expand(-1, cache.shape[1]))
    state.add_(1)
    return ids * scale + state[0], cache.sum(1)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (4,), generator=g), torch.randperm(8, generator=g)[:4]


def test_replay_fills_static_inputs_in_place_and_matches_direct_calls():
    cap = FakeCapturer()
    state, cache = torch.zeros(2), torch.zeros(8, 3)
    ref_state, ref_cache = torch.zeros(2), torch.zeros(8, 3)
    g = ReplayedGraph(decode_like, cap, "decode_b4")
    static_ptrs = None
    for step in range(5):
        ids, pos = _inputs(step)
        got = g(ids, pos, state, cache, 3)
        want = decode_like(ids, pos, ref_state, ref_cache, 3)
        for a, b in zip(got, want):
            assert torch.equal(a, b), step
        ptrs = [t.data_ptr() for t in g._static if isinstance(t, torch.Tensor)]
        static_ptrs = static_ptrs or ptrs
        assert ptrs == static_ptrs  # the same buffers every step: filled, never replaced
    assert torch.equal(state, ref_state) and torch.equal(cache, ref_cache)  # persistent tensors used in place
    assert cap.captures == 1 and cap.first_runs == 1 and g.replays == 4


def test_first_call_runs_once_and_outputs_survive_the_next_replay():
    cap = FakeCapturer()
    state, cache = torch.zeros(2), torch.zeros(8, 3)
    g = ReplayedGraph(decode_like, cap, "decode_b4")
    first = g(*_inputs(0), state, cache, 1)
    assert state[0] == 1  # the first call executed exactly once
    second = g(*_inputs(1), state, cache, 1)
    third = g(*_inputs(2), state, cache, 1)
    assert state[0] == 3
    assert not torch.equal(second[0], third[0])  # each result is its own copy, not the graph's buffer
    assert first[0][0] != second[0][0] or first[0][1] != second[0][1]


def test_mismatched_inputs_are_refused():
    g = ReplayedGraph(decode_like, FakeCapturer(), "decode_b4")
    state, cache = torch.zeros(2), torch.zeros(8, 3)
    ids, pos = _inputs(0)
    g(ids, pos, state, cache, 3)
    with pytest.raises(RuntimeError, match="decode_b4: input 0 is a torch.int64 tensor of shape \\(5,\\)"):
        g(torch.zeros(5, dtype=torch.long), pos, state, cache, 3)
    # Another dtype of the same shape is converted into the captured buffer (e.g. tokens passed on the device).
    ids2, pos2 = _inputs(1)
    assert torch.equal(g(ids2.int(), pos2, state, cache, 3)[0], ids2 * 3 + state[0])
    with pytest.raises(RuntimeError, match="input 4 is 2, captured as 3"):
        g(ids, pos, state, cache, 2)
    with pytest.raises(RuntimeError, match="other arguments"):
        g(ids, pos, state, [cache], 3)


def test_which_buckets_are_captured():
    assert wants_capture("decode", "decode") and not wants_capture("decode", "prefill")
    assert wants_capture("all", "prefill") and not wants_capture("off", "decode")


def test_cpu_and_eager_runs_never_capture(monkeypatch):
    from vllm_neuron.worker.cuda_graphs import cuda_graph_capturer

    monkeypatch.delenv("VLLM_NEURON_CUDA_GRAPHS", raising=False)
    assert cuda_graph_capturer(torch.device("cpu"), "native") == ("off", None)
    assert cuda_graph_capturer(torch.device("cuda"), "eager") == ("off", None)
    monkeypatch.setenv("VLLM_NEURON_CUDA_GRAPHS", "off")
    assert cuda_graph_capturer(torch.device("cuda"), "native") == ("off", None)
    monkeypatch.setenv("VLLM_NEURON_CUDA_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="VLLM_NEURON_CUDA_GRAPHS='sometimes'; valid values: decode, all, off"):
        cuda_graph_capturer(torch.device("cuda"), "native")


def test_failed_capture_falls_back_to_direct_calls(caplog):
    class Failing(FakeCapturer):
        def capture(self, run):
            raise RuntimeError("operation not permitted when stream is capturing")

    state, cache = torch.zeros(2), torch.zeros(8, 3)
    ref_state, ref_cache = torch.zeros(2), torch.zeros(8, 3)
    g = ReplayedGraph(decode_like, Failing(), "prefill_s32")
    for step in range(3):
        ids, pos = _inputs(step)
        got, want = g(ids, pos, state, cache, 2), decode_like(ids, pos, ref_state, ref_cache, 2)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert g.replays == 0 and torch.equal(state, ref_state)
    assert "prefill_s32: CUDA graph capture failed (RuntimeError: operation not permitted" in caplog.text
