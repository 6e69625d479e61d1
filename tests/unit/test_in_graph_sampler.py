"""In-graph sampler: greedy, top-k, top-p, inverse-CDF sampling with static shapes."""
import pytest
import torch

from vllm_neuron.model.layers.in_graph_sampler import apply_token_bitmask, greedy_in_graph, sample_in_graph


def _params(b, temperature=1.0, top_k=0, top_p=1.0):
    return (torch.full((b,), temperature, dtype=torch.float32),
            torch.full((b,), top_k, dtype=torch.int64),
            torch.full((b,), top_p, dtype=torch.float32))


def test_greedy_rows_take_full_vocab_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    # Put each row's best token far down the order of a 256-wide top-k to prove the full vocab is used.
    temp, k, p = _params(6, temperature=0.0, top_k=3, top_p=0.1)
    out = sample_in_graph(logits, temp, k, p, torch.rand(6), max_top_k=4)
    assert out.tolist() == logits.argmax(-1).tolist()
    assert greedy_in_graph(logits).tolist() == logits.argmax(-1).tolist()


def test_top_k_one_is_argmax_at_any_temperature():
    torch.manual_seed(1)
    logits = torch.randn(8, 500)
    temp = torch.tensor([0.1, 0.5, 1.0, 1.5, 2.0, 0.7, 1.2, 1.9])
    _, k, p = _params(8, top_k=1)
    for _ in range(5):
        out = sample_in_graph(logits, temp, k, p, torch.rand(8))
        assert out.tolist() == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_and_random_rows():
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    temp = torch.tensor([0.0, 1.0, 0.0, 1.0])
    k = torch.tensor([0, 0, 0, 0])
    p = torch.ones(4)
    seen = {1: set(), 3: set()}
    for _ in range(50):
        out = sample_in_graph(logits, temp, k, p, torch.rand(4))
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
        seen[1].add(int(out[1]))
        seen[3].add(int(out[3]))
    assert len(seen[1]) > 3 and len(seen[3]) > 3


def _expected(logits_row, temperature, top_k, top_p, max_top_k):
    probs = torch.softmax(logits_row.double() / temperature, -1)
    order = torch.argsort(probs, descending=True)
    if top_k <= 0 and top_p >= 1.0:
        return probs  # nothing truncates: the whole vocabulary
    # top_k off: top-p's mass is over the whole vocabulary, looking at no more than max_top_k tokens.
    kept = order[:max_top_k] if top_k <= 0 else order[:min(top_k, max_top_k)]
    p = probs[kept] if top_k <= 0 else probs[kept] / probs[kept].sum()
    # Smallest prefix whose mass reaches top_p.
    n = min(int((torch.cumsum(p, 0) < top_p).sum()) + 1, len(kept))
    kept = kept[:n]
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


@pytest.fixture(params=[False, True], ids=["torch", "kernel"])
def use_kernels(request):
    """Both samplers: the torch one (CUDA, kernels off) and the CPU kernel (kernels/sampler.cpp)."""
    if request.param:
        request.getfixturevalue("sampler_kernels")
    return request.param


@pytest.mark.parametrize("temperature, top_k, top_p, max_top_k", [
    (1.0, 0, 1.0, 16),   # top_k off: the whole vocabulary
    (1.0, 0, 0.99, 8),   # top_k off: top-p cut at max_top_k tokens
    (0.7, 5, 1.0, 16),
    (1.3, 0, 0.6, 16),
    (1.0, 8, 0.8, 16),
    (1.0, -1, 0.9, 5),
])
def test_empirical_distribution_matches(temperature, top_k, top_p, max_top_k, use_kernels):
    gen = torch.Generator().manual_seed(3)
    logits_row = torch.randn(40, generator=gen) * 1.5
    n = 20000
    logits = logits_row.expand(n, 40)
    temp, k, p = _params(n, temperature, top_k, top_p)
    # Evenly spread uniforms: the inverse CDF then reproduces the distribution almost exactly.
    uniform = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    out = sample_in_graph(logits, temp, k, p, uniform, max_top_k=max_top_k, use_kernels=use_kernels)
    freq = torch.bincount(out, minlength=40).double() / n
    expected = _expected(logits_row, temperature, top_k, top_p, max_top_k)
    assert torch.allclose(freq, expected, atol=2e-3), (freq - expected).abs().max()
    assert set(out.unique().tolist()) == set(torch.nonzero(expected).flatten().tolist())


def test_uniform_extremes_stay_in_kept_set(use_kernels):
    torch.manual_seed(4)
    logits = torch.randn(3, 100)
    temp, k, p = _params(3, top_k=4, top_p=0.5)
    lo = sample_in_graph(logits, temp, k, p, torch.zeros(3), use_kernels=use_kernels)
    # u = 0: the first kept token in token-id order.
    assert lo.tolist() == [int(torch.nonzero(_expected(logits[r], 1.0, 4, 0.5, 256))[0]) for r in range(3)]
    # 1.0 is outside the contract, but rounding can make u * mass reach the mass: it must still
    # land on a kept token, never on a masked one or past the end.
    for u in (1.0 - 2 ** -24, 1.0):
        hi = sample_in_graph(logits, temp, k, p, torch.full((3,), u), use_kernels=use_kernels)
        for r in range(3):
            assert int(hi[r]) in logits[r].topk(4).indices.tolist()


def test_small_vocab_below_max_top_k_and_bf16(use_kernels):
    logits = torch.tensor([[0.0, 5.0, 1.0]], dtype=torch.bfloat16)
    temp, k, p = _params(1, top_k=-1)
    outs = {int(sample_in_graph(logits, temp, k, p, torch.tensor([u]), use_kernels=use_kernels))
            for u in (0.0, 0.5, 0.999)}
    assert 1 in outs and outs <= {0, 1, 2}


def test_compiled_equals_eager():
    torch.manual_seed(5)
    b, v = 4, 64
    logits = torch.randn(b, v)
    temp = torch.tensor([0.0, 0.8, 1.0, 1.5])
    k = torch.tensor([0, 5, -1, 20])
    p = torch.tensor([1.0, 0.9, 0.5, 0.95])
    compiled = torch.compile(sample_in_graph, fullgraph=True, dynamic=False)
    for _ in range(3):
        u = torch.rand(b)
        assert compiled(logits, temp, k, p, u, max_top_k=32).tolist() == \
            sample_in_graph(logits, temp, k, p, u, max_top_k=32).tolist()


def _greedy_fast_path_ops(temperature: torch.Tensor) -> set[str]:
    torch.manual_seed(6)
    logits = torch.randn(4, 300)
    k, p = torch.tensor([0, 5, 0, 0]), torch.tensor([1.0, 1.0, 0.9, 1.0])
    compiled = torch.compile(sample_in_graph, fullgraph=True, dynamic=False)
    out = compiled(logits, temperature, k, p, torch.rand(4))
    with torch.profiler.profile() as prof:
        again = compiled(logits, temperature, k, p, torch.rand(4))
    if not bool((temperature > 0).any()):
        assert out.tolist() == again.tolist() == logits.argmax(-1).tolist()  # parity with the argmax
    return {e.name for e in prof.events()}


def test_all_greedy_batch_skips_top_k_top_p_and_cdf_in_the_compiled_graph():
    greedy_ops = _greedy_fast_path_ops(torch.zeros(4))
    mixed_ops = _greedy_fast_path_ops(torch.tensor([0.0, 0.8, 1.0, 0.0]))
    assert "aten::topk" in mixed_ops and "aten::topk" not in greedy_ops
    assert "aten::cumsum" not in greedy_ops


def test_host_sampler_and_graph_give_the_same_token_for_the_same_number(use_kernels):
    """One seeded scheme on every path: host_sample (temperature, top-k, top-p) picks the graph's token
    from the same logits and the same counter_uniform number (with the kernels on, both take the kernel)."""
    from vllm_neuron.model.layers.in_graph_sampler import counter_uniform
    from vllm_neuron.sampling_params import SamplingParams
    from vllm_neuron.worker.host_sampler import HostSamplingRow, host_sample

    torch.manual_seed(7)
    n, v = 64, 500
    logits = torch.randn(n, v) * 2
    gen = torch.Generator().manual_seed(8)
    temp = torch.rand(n, generator=gen) * 1.5 + 0.2
    top_k = torch.randint(-1, 60, (n,), generator=gen)
    top_p = torch.where(torch.rand(n, generator=gen) < 0.5, torch.ones(n), torch.rand(n, generator=gen) * 0.9 + 0.1)
    u = counter_uniform(torch.arange(n), torch.full((n,), 17))
    graph = sample_in_graph(logits, temp, top_k, top_p, u, max_top_k=64, use_kernels=use_kernels)
    rows = [HostSamplingRow(SamplingParams(temperature=float(temp[i]), top_k=int(top_k[i]), top_p=float(top_p[i])),
                            [1], [], float(u[i])) for i in range(n)]
    host = host_sample(logits, rows, max_top_k=64, use_kernels=use_kernels).token_ids
    assert host == graph.tolist()
    assert len(set(host)) > n // 2  # really random rows


def test_token_bitmask_masks_constrained_rows_and_skips_the_unpack_without_constraints():
    torch.manual_seed(7)
    b, v = 3, 70  # 3 words per row, the last one partly past the vocabulary
    logits = torch.randn(b, v)
    free = torch.full((b, 3), -1, dtype=torch.int32)
    constrained = free.clone()
    constrained[1] = torch.tensor([0b1011, 0, 1 << 5], dtype=torch.int32)  # tokens 0, 1, 3 and 69
    expected = logits.clone()
    expected[1] = float("-inf")
    expected[1, [0, 1, 3, 69]] = logits[1, [0, 1, 3, 69]]
    names = {}
    # Inductor names its fused kernels in the profile only with kernel profiling on (set when compiling).
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        compiled = torch.compile(apply_token_bitmask, fullgraph=True, dynamic=False)
        for fn in (apply_token_bitmask, compiled):
            assert torch.equal(fn(logits, constrained), expected)
            out = fn(logits, free)
            assert torch.equal(out, logits) and out.data_ptr() != logits.data_ptr()
        for name, bitmask in (("free", free), ("constrained", constrained)):
            with torch.profiler.profile() as prof:
                compiled(logits, bitmask)
            names[name] = " ".join(e.name for e in prof.events())
    assert "masked_fill" in names["constrained"] and "masked_fill" not in names["free"], names


def test_eager_calls_take_a_python_branch_not_torch_cond(monkeypatch):
    """Outside a compiled graph (host sampler, eager execution) torch.cond cost ~2 ms a call: both branch
    points run the branch their predicate picks, with the same results as the compiled graph."""
    def no_cond(*args, **kwargs):
        raise AssertionError("torch.cond called outside a compiled graph")

    torch.manual_seed(3)
    logits = torch.randn(4, 300)
    greedy = torch.zeros(4)
    mixed = torch.tensor([0.0, 0.8, 1.0, 1.3])
    top_k, top_p = torch.tensor([0, 5, 0, 40]), torch.tensor([1.0, 1.0, 0.7, 0.9])
    u = torch.tensor([0.1, 0.5, 0.7, 0.95])
    free = torch.full((4, 10), -1, dtype=torch.int32)
    constrained = free.clone()
    constrained[2] = 0
    constrained[2, 0] = 0b110  # tokens 1 and 2 only
    expected = [sample_in_graph(logits, t, top_k, top_p, u, max_top_k=64) for t in (greedy, mixed)]
    masked = apply_token_bitmask(logits, constrained)
    monkeypatch.setattr(torch, "cond", no_cond)
    assert torch.equal(sample_in_graph(logits, greedy, top_k, top_p, u, max_top_k=64), logits.argmax(-1))
    assert torch.equal(sample_in_graph(logits, greedy, top_k, top_p, u, max_top_k=64), expected[0])
    assert torch.equal(sample_in_graph(logits, mixed, top_k, top_p, u, max_top_k=64), expected[1])
    assert not torch.equal(expected[0], expected[1])  # the random branch really ran
    out = apply_token_bitmask(logits, free)
    assert torch.equal(out, logits) and out.data_ptr() != logits.data_ptr()
    assert torch.equal(apply_token_bitmask(logits, constrained), masked)
    assert masked[2].isfinite().nonzero().flatten().tolist() == [1, 2]
    assert torch.equal(masked[[0, 1, 3]], logits[[0, 1, 3]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 33, 1000, 49152])
def test_kernel_argmax_is_torch_argmax_on_ties_nan_and_minus_inf(sampler_kernels, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g).to(dtype)
    x[1, vocab // 2] = x[1].max()  # a tie: the first index wins
    x[2] = float("-inf")
    x[3, vocab - 1] = float("inf")
    if vocab > 3:
        x[4, 2] = float("nan")  # a NaN wins over everything, the first one
        x[4, vocab - 1] = float("nan")
    x[5] = x[5, 0]  # a constant row
    got = greedy_in_graph(x, True)
    assert got.dtype == torch.long and torch.equal(got, torch.argmax(x, dim=-1))
    torch._dynamo.reset()  # one compile per case, past dynamo's recompile limit
    compiled = torch.compile(lambda lg: greedy_in_graph(lg, True), fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), torch.argmax(x, dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_bitmask_masks_in_place_exactly_as_the_unpack(sampler_kernels, dtype):
    from vllm_neuron.model.layers.in_graph_sampler import _masked

    g = torch.Generator().manual_seed(5)
    b, v = 4, 70  # the last word partly past the vocabulary
    logits = torch.randn(b, v, generator=g).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (b, 3), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # unconstrained
    bitmask[2] = 0  # nothing allowed
    bitmask[3, 0] = 0b1011
    expected = _masked(logits, bitmask)
    assert torch.equal(expected[0], logits[0]) and torch.isinf(expected[2]).all()
    x = logits.clone()
    out = apply_token_bitmask(x, bitmask, True)
    assert out.data_ptr() == x.data_ptr() and torch.equal(out, expected)
    compiled = torch.compile(lambda lg, bm: greedy_in_graph(apply_token_bitmask(lg.clone(), bm, True), True),
                             fullgraph=True)
    assert torch.equal(compiled(logits, bitmask), torch.argmax(expected, dim=-1))
    with pytest.raises(RuntimeError, match="bitmask must be"):
        torch.ops.vllm_neuron.apply_token_bitmask_(logits.clone(), bitmask[:, :2].contiguous())


def test_kernel_sampler_matches_the_torch_sampler(sampler_kernels):
    """Greedy and random rows give the same tokens with the kernels on as off, on bf16 logits."""
    torch.manual_seed(11)
    logits = (torch.randn(8, 3000) * 3).bfloat16()
    temp = torch.tensor([0.0, 0.7, 0.0, 1.2, 0.0, 0.0, 0.9, 0.0])
    top_k, top_p = torch.tensor([0, 20, 0, 0, 5, 0, 50, 0]), torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0, 1.0, 1.0, 1.0])
    u = torch.rand(8)
    runs = {}
    for on in (True, False):
        runs[on] = [sample_in_graph(logits, t, top_k, top_p, u, max_top_k=64, use_kernels=on)
                    for t in (temp, torch.zeros(8))]
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False]))
    assert torch.equal(runs[True][1], logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_draw_is_the_torch_draw_on_a_large_vocabulary(sampler_kernels, dtype):
    """Every kind of row (greedy; top-k below, at and above the search width; top-p with top-k on and off;
    nothing truncated; tokens the grammar forbade) draws the torch sampler's token from the same number."""
    g = torch.Generator().manual_seed(12)
    n, v = 96, 49152
    logits = (torch.randn(n, v, generator=g) * 2.5).to(dtype)
    logits[::7, ::3] = float("-inf")  # a grammar's mask on some rows
    temp = torch.rand(n, generator=g) * 1.6 + 0.1
    temp[::11] = 0.0
    top_k = torch.tensor([(0, -1, 1, 5, 40, 256, 300)[i % 7] for i in range(n)])
    top_p = torch.where(torch.rand(n, generator=g) < 0.5, torch.ones(n), torch.rand(n, generator=g) * 0.95 + 0.02)
    u = torch.rand(n, generator=g)
    ref = sample_in_graph(logits, temp, top_k, top_p, u, width=300)
    got = sample_in_graph(logits, temp, top_k, top_p, u, width=300, use_kernels=True)
    assert got.tolist() == ref.tolist()
    assert torch.isfinite(logits.gather(1, got[:, None]).float()).all()
    assert len(set(got.tolist())) > n // 2  # really random rows


def test_kernel_draw_never_takes_a_forbidden_token_at_the_top_end(sampler_kernels):
    """u at and past the top end: the last token with mass, never a -inf (grammar-forbidden) one after it."""
    logits = torch.full((2, 500), float("-inf"))
    logits[:, 100:110] = torch.randn(2, 10)
    temp, k, p = _params(2)
    for u in (1.0 - 2 ** -24, 1.0, 0.0):
        got = sample_in_graph(logits, temp, k, p, torch.full((2,), u), use_kernels=True)
        assert all(100 <= t < 110 for t in got.tolist()), (u, got)


def test_kernel_sampler_compiles_to_one_op_call(sampler_kernels):
    """In a compiled graph the kernel path is one call: no top-k, cumsum or cond for inductor to generate."""
    torch.manual_seed(13)
    logits = torch.randn(4, 300)
    temp, k, p = torch.tensor([0.0, 0.8, 1.0, 0.5]), torch.tensor([0, 5, 0, 0]), torch.tensor([1.0, 1.0, 0.9, 1.0])
    compiled = torch.compile(lambda *a: sample_in_graph(*a, max_top_k=32, use_kernels=True), fullgraph=True,
                             dynamic=False)
    u = torch.rand(4)
    out = compiled(logits, temp, k, p, u)
    with torch.profiler.profile() as prof:
        again = compiled(logits, temp, k, p, u)
    names = {e.name for e in prof.events()}
    assert "vllm_neuron::sample_rows" in names and not names & {"aten::topk", "aten::cumsum", "aten::cond"}
    assert out.tolist() == again.tolist() == sample_in_graph(logits, temp, k, p, u, max_top_k=32).tolist()


def test_kernel_sampler_refuses_mismatched_rows(sampler_kernels):
    temp, k, p = _params(3)
    with pytest.raises(RuntimeError, match=r"must be \[rows\]"):
        torch.ops.vllm_neuron.sample_rows(torch.randn(4, 10), temp, k, p, torch.rand(3), 8, 8)
    with pytest.raises(RuntimeError, match="must be positive"):
        torch.ops.vllm_neuron.sample_rows(torch.randn(3, 10), temp, k, p, torch.rand(3), 0, 8)
