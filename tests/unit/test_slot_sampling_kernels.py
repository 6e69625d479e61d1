"""Model Runner V2's sampling end as CPU ops (kernels/sampler.cpp): a row's parameters read from its batch slot, its
number hashed from the slot's seed and the row's position, and the sampled token and position stored back in place."""
import pytest
import torch

from vllm_neuron.model.layers.in_graph_sampler import counter_uniform, fold_seed, sample_in_graph, sample_slots

pytestmark = pytest.mark.usefixtures("sampler_kernels")  # tests/unit/conftest.py


def _state(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    temperature = torch.rand(n, generator=g) * 1.5 + 0.2
    temperature[::4] = 0.0  # greedy slots
    top_p = torch.where(torch.rand(n, generator=g) < 0.5, torch.ones(n), torch.rand(n, generator=g) * 0.9 + 0.05)
    seeds = torch.tensor([fold_seed(s) for s in torch.randint(-2**62, 2**62, (n,), generator=g).tolist()])
    return {"temperature": temperature, "top_k": torch.tensor([(0, 3, 50, -1)[i % 4] for i in range(n)]),
            "top_p": top_p, "seed": seeds}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slot_kernel_draws_the_torch_gathers_and_hash(dtype):
    """Each row samples with its slot's parameters and counter_uniform(seed[slot], position): the same token as
    the torch path's gathers, hash and sampler (so the C++ hash is the Python one, bit for bit)."""
    g = torch.Generator().manual_seed(21)
    n_slots, rows, vocab = 33, 24, 5000
    state = _state(n_slots, g)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    slots = torch.randperm(n_slots - 1, generator=g)[:rows]
    slots[-3:] = n_slots - 1  # padding rows: the dummy slot
    positions = torch.randint(0, 2**31, (rows,), generator=g)
    args = (logits, slots, positions, state["temperature"], state["top_k"], state["top_p"], state["seed"], 64)
    got = sample_slots(*args, use_kernels=True)
    assert got.tolist() == sample_slots(*args, use_kernels=False).tolist()
    s = slots
    assert got.tolist() == sample_in_graph(logits, state["temperature"][s], state["top_k"][s], state["top_p"][s],
                                           counter_uniform(state["seed"][s], positions), 64).tolist()
    # The number moves with the position: the same slot one position on draws differently somewhere.
    moved = sample_slots(logits, slots, positions + 1, *args[3:], use_kernels=True)
    assert moved.tolist() != got.tolist()


def test_slot_kernel_in_a_compiled_graph_and_bad_slots():
    g = torch.Generator().manual_seed(22)
    state = _state(5, g)
    logits, slots, pos = torch.randn(3, 300, generator=g), torch.tensor([1, 2, 4]), torch.tensor([7, 8, 9])
    fn = torch.compile(lambda lg, sl, p, t, k, tp, sd: sample_slots(lg, sl, p, t, k, tp, sd, 32, use_kernels=True),
                       fullgraph=True, dynamic=False)
    vals = (state["temperature"], state["top_k"], state["top_p"], state["seed"])
    assert fn(logits, slots, pos, *vals).tolist() == sample_slots(logits, slots, pos, *vals, 32).tolist()
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.vllm_neuron.sample_slots(logits, torch.tensor([1, 2, 5]), pos, *vals, 32, 32)
    with pytest.raises(RuntimeError, match=r"must be \[rows\]"):
        torch.ops.vllm_neuron.sample_slots(logits, slots[:2], pos, *vals, 32, 32)


def test_store_token_state_writes_rows_in_place_and_keeps_the_dummy_slot_at_zero():
    """Inside a compiled graph too: the op writes the graph's own input tensors (no copy left behind)."""
    n = 6
    last_token, position = torch.arange(100, 100 + n), torch.arange(10, 10 + n)
    slots, tokens, next_pos = torch.tensor([3, 0, 5, 5]), torch.tensor([7, 8, 9, 9]), torch.tensor([40, 41, 42, 43])
    store = torch.compile(lambda lt, po, sl, tk, npos: torch.ops.vllm_neuron.store_token_state_(lt, po, sl, tk, npos),
                          fullgraph=True, dynamic=False)
    store(last_token, position, slots, tokens, next_pos)
    assert last_token.tolist() == [8, 101, 102, 7, 104, 0]
    assert position.tolist() == [41, 11, 12, 40, 14, 0]
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.vllm_neuron.store_token_state_(last_token, position, torch.tensor([6]), tokens[:1], next_pos[:1])
    with pytest.raises(RuntimeError, match="contiguous int64"):
        torch.ops.vllm_neuron.store_token_state_(last_token.int(), position, slots, tokens, next_pos)
