"""Model Runner V2 vs transformers and vs MRv1 on the same tiny random Llama (fp32).

MRv2 keeps each request's last token, position, block table and sampling parameters in device
tensors, so these tests hide the decode chunks' token ids from it (as async scheduling does with
placeholders) and check that greedy output still equals transformers through padding, segmented
prefill, prefix caching, several decode/context buckets, joins and leaves mid-stream and
preemption; that host-sampled rows (penalties, logprobs, allowed tokens) match MRv1; and that a
seeded random request samples the same tokens whatever its batch neighbours.
"""
from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch

from tests.model_factory import build_tiny_llama, hf_greedy_reference, shared_prefix_prompts
from tests.parity.parity_utils import LLAMA_ENGINE, fp32_llm, generate_ids
from vllm_neuron import LLM, SamplingParams
from vllm_neuron.config.compatibility import V2_LOG_LINE
from vllm_neuron.step import PLACEHOLDER_TOKEN_ID
from vllm_neuron.model.layers.in_graph_sampler import counter_uniform, fold_seed
from vllm_neuron.worker.batch_state import BatchState, SlotParams
from vllm_neuron.worker.model_runner_v1 import ModelRunnerV1
from vllm_neuron.worker.model_runner_v2 import ModelRunnerV2

pytestmark = pytest.mark.engine

MAX_NEW = 10
# Around block (16) and bucket edges, and beyond max_num_batched_tokens (128): segmented prefill.
LENGTHS = [3, 16, 17, 40, 70, 129, 200]
SHARED = 64  # prompts 3.. share a prefix, so a second pass (and a re-prefill) hits the prefix cache


def _prompts() -> list[list[int]]:
    return shared_prefix_prompts(LENGTHS, SHARED, first_shared=3, seed=1)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_512_dir) -> str:
    return tiny_llama_512_dir


@pytest.fixture(scope="module")
def hf():
    return build_tiny_llama(max_position_embeddings=512).eval()


def _hf_greedy(hf, prompts: list[list[int]], n: int = MAX_NEW) -> list[list[int]]:
    return hf_greedy_reference(hf, prompts, n, logits=False)[0]


@pytest.fixture(scope="module")
def reference(hf) -> list[list[int]]:
    return _hf_greedy(hf, _prompts())


class _Spy:
    """Wraps the runner's execute: hides decode token ids (what async scheduling may send) and records
    each step's bucket and the runner's number of held slots."""

    def __init__(self, runner) -> None:
        self.runner, self.execute = runner, runner.execute
        self.buckets: list[str] = []
        self.max_active = 0
        runner.execute = self

    def __call__(self, sched):
        if sched.kind == "decode":
            hidden = [dataclasses.replace(c, token_ids=[PLACEHOLDER_TOKEN_ID]) for c in sched.chunks]
            sched = dataclasses.replace(sched, chunks=hidden)
        out = self.execute(sched)
        self.buckets.append(out.bucket_name)
        self.max_active = max(self.max_active, self.runner.state.num_active)
        return out


def _engine(model_dir: str, monkeypatch, runner: str = "1", **kw) -> LLM:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    return fp32_llm(model_dir, LLAMA_ENGINE, **{"enforce_eager": True, **kw})


def _greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _gen(llm: LLM, params, prompts=None) -> list[list[int]]:
    outs = generate_ids(llm, _prompts() if prompts is None else prompts, params)
    return [o.outputs[0].token_ids for o in outs]


# -- engine-level parity ---------------------------------------------------------------------------

def test_eager_greedy_matches_transformers_with_prefix_cache(model_dir, reference, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="vllm_neuron"):
        llm = _engine(model_dir, monkeypatch)
    core = llm.llm_engine.core
    assert isinstance(core.runner, ModelRunnerV2) and core.config.use_v2_model_runner
    assert V2_LOG_LINE in caplog.text
    assert "VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with unsupported features (eager " \
           "execution (enforce_eager)); execution may fail." in caplog.text
    spy = _Spy(core.runner)
    assert _gen(llm, _greedy()) == reference
    hits = core.scheduler.kv.prefix_hits
    assert _gen(llm, _greedy()) == reference  # second pass starts from cached blocks
    assert core.scheduler.kv.prefix_hits > hits
    # Segments and cache hits attend context: through a context bucket on the torch path, through block
    # tables in the kernel (which has no context buckets).
    with_ctx = any(b.startswith("prefill_s128_c") for b in spy.buckets)
    assert with_ctx != core.runner.kernels.attention
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks - 1


def test_small_buckets_segments_and_context_buckets(model_dir, reference, monkeypatch):
    llm = _engine(model_dir, monkeypatch, max_num_batched_tokens=32, max_num_seqs=4,
                  additional_config={"neuron_config": {"num_batched_tokens_buckets": [8, 32],
                                                       "num_seqs_buckets": [1, 4],
                                                       "decode_context_length_buckets": [128, 256]}})
    spy = _Spy(llm.llm_engine.core.runner)
    assert _gen(llm, _greedy()) == reference
    decode = {b for b in spy.buckets if b.startswith("decode")}
    # Longest sequence 210 tokens: 128 and 256 used, at both batch sizes (the last decodes run alone).
    assert decode == {"decode_b1_c128", "decode_b1_c256", "decode_b4_c128", "decode_b4_c256"}, decode
    assert spy.max_active <= 4


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_joins_and_leaves_mid_stream_match_alone(model_dir, reference, monkeypatch, async_scheduling):
    """Staggered arrivals with different max_tokens: every request's tokens equal its tokens alone,
    with the engine scheduling one step ahead (async) or not."""
    llm = _engine(model_dir, monkeypatch, max_num_seqs=4, async_scheduling=async_scheduling)
    assert llm.llm_engine.core.async_scheduling == async_scheduling
    spy = _Spy(llm.llm_engine.core.runner)
    engine = llm.llm_engine
    prompts = _prompts()
    max_tokens = [10, 3, 7, 1, 10, 5, 9]
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5], 9: [6]}  # step -> prompt indices
    done: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, _greedy(max_tokens[i]))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 500
    for i, n in enumerate(max_tokens):
        assert done[str(i)] == reference[i][:n], f"prompt {i}"
    assert spy.max_active <= 4  # leaves free slots for later joins


def test_preemption_keeps_greedy_output(model_dir, hf, monkeypatch):
    # One prefill step of prompts that fill whole blocks takes all 16 usable blocks; every first decode
    # needs one more, so the newest requests are preempted and prefilled again later (from their
    # cached prefix) in a fresh slot. Async scheduling: preemption hits requests with a step in flight.
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (16, 16, 32, 48, 64, 80)]
    llm = _engine(model_dir, monkeypatch, max_model_len=256, max_num_batched_tokens=256,
                  num_gpu_blocks_override=17, async_scheduling=True)
    spy = _Spy(llm.llm_engine.core.runner)
    assert _gen(llm, _greedy(), prompts) == _hf_greedy(hf, prompts)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert spy.max_active <= 8


def test_seeded_sampling_does_not_depend_on_batch(model_dir, reference, monkeypatch):
    llm = _engine(model_dir, monkeypatch)
    _Spy(llm.llm_engine.core.runner)
    prompts = _prompts()
    seeded = SamplingParams(temperature=1.5, top_k=40, top_p=0.95, seed=1234, max_tokens=MAX_NEW, ignore_eos=True)
    alone = _gen(llm, seeded, [prompts[4]])[0]
    assert alone != reference[4]  # really sampled, not greedy
    others = [SamplingParams(temperature=1.0, max_tokens=MAX_NEW - i, ignore_eos=True) for i in range(3)]
    batch = _gen(llm, [others[0], _greedy(), seeded, others[1], others[2]], [prompts[i] for i in (0, 1, 4, 5, 6)])
    assert batch[2] == alone
    assert batch[1] == reference[1]
    other_seed = SamplingParams(temperature=1.5, top_k=40, top_p=0.95, seed=99, max_tokens=MAX_NEW, ignore_eos=True)
    assert _gen(llm, other_seed, [prompts[4]])[0] != alone


def test_seeded_tokens_do_not_depend_on_the_sampling_path(model_dir, reference, monkeypatch):
    """One seeded scheme: in the graph of MRv1 or MRv2, or on the host (logprobs, a no-op logit bias),
    a seeded request samples the same tokens; top_k off samples the whole vocabulary on every path."""
    prompts = _prompts()[:3]
    base = dict(temperature=1.0, seed=42, max_tokens=MAX_NEW, ignore_eos=True)
    variants = {"graph": SamplingParams(**base), "logprobs": SamplingParams(**base, logprobs=1),
                "no-op logit_bias": SamplingParams(**base, logit_bias={5: 0.0}),
                "top_p": SamplingParams(**base, top_p=0.9), "top_p on host": SamplingParams(**base, top_p=0.9, logprobs=0)}
    results = {}
    for runner in ("0", "1"):
        llm = _engine(model_dir, monkeypatch, runner=runner)
        for name, params in variants.items():
            results[(runner, name)] = _gen(llm, params, prompts)
    plain, top_p = results[("1", "graph")], results[("1", "top_p")]
    assert plain != reference[:3] and plain != top_p  # really sampled
    for (runner, name), out in results.items():
        assert out == (top_p if name.startswith("top_p") else plain), (runner, name)


@pytest.mark.parametrize("runner", ["0", "1"])
def test_preemption_keeps_seeded_output(model_dir, monkeypatch, runner):
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (16, 16, 32, 48, 64, 80)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_NEW, ignore_eos=True, logprobs=i % 2 or None)
              for i in range(len(prompts))]
    kw = dict(max_model_len=256, max_num_batched_tokens=256, async_scheduling=True)
    roomy = _gen(_engine(model_dir, monkeypatch, runner=runner, **kw), params, prompts)
    tight = _engine(model_dir, monkeypatch, runner=runner, num_gpu_blocks_override=17, **kw)
    assert _gen(tight, params, prompts) == roomy
    assert tight.llm_engine.core.scheduler.num_preemptions > 0


def test_host_sampled_rows_match_mrv1(model_dir, monkeypatch):
    """Penalties, logprobs and allowed tokens are sampled on the host; MRv2 must feed the host's
    token (not the graph's) into the next step. Mixed with graph-sampled rows in the same batches."""
    prompts = _prompts()[:5]
    allowed = list(range(1000, 1300))
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.5,
                             logprobs=3),
              _greedy(),
              SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, presence_penalty=1.0,
                             frequency_penalty=0.5),
              _greedy(logprobs=2)]
    results = {}
    for runner in ("0", "1"):
        llm = _engine(model_dir, monkeypatch, runner=runner)
        assert isinstance(llm.llm_engine.core.runner, ModelRunnerV2) == (runner == "1")
        if runner == "1":
            _Spy(llm.llm_engine.core.runner)
        else:
            assert type(llm.llm_engine.core.runner) is ModelRunnerV1
        results[runner] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (v1, v2) in enumerate(zip(results["0"], results["1"])):
        assert v2.outputs[0].token_ids == v1.outputs[0].token_ids, f"prompt {i}"
        lp1, lp2 = v1.outputs[0].logprobs, v2.outputs[0].logprobs
        assert (lp1 is None) == (lp2 is None)
        for e1, e2 in zip(lp1 or [], lp2 or []):
            assert e1.keys() == e2.keys()
            assert all(abs(e1[t].logprob - e2[t].logprob) < 1e-5 for t in e1)
    assert set(results["1"][2].outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize("odsc", [None, {"all_greedy": True}], ids=["cpu_sampling", "all_greedy"])
def test_forced_v2_other_sampling_configs(model_dir, reference, monkeypatch, odsc):
    """CPU sampling (every row on the host, forced onto MRv2) and an all-greedy graph."""
    llm = _engine(model_dir, monkeypatch, additional_config={"neuron_config": {"on_device_sampling_config": odsc}})
    assert isinstance(llm.llm_engine.core.runner, ModelRunnerV2)
    _Spy(llm.llm_engine.core.runner)
    assert _gen(llm, _greedy()) == reference


def test_compiled_default_runner_matches_transformers_and_eager(model_dir, reference, monkeypatch, tmp_path):
    """VLLM_USE_V2_MODEL_RUNNER unset and compiled graphs: MRv2 is the default; two small buckets."""
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    kw = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128, block_size=16, dtype="float32",
              device="cpu", num_gpu_blocks_override=64, enable_prefix_caching=False,
              additional_config={"neuron_config": {"num_batched_tokens_buckets": [128], "num_seqs_buckets": [4]}})
    llm = LLM(model_dir, **kw)
    core = llm.llm_engine.core
    assert isinstance(core.runner, ModelRunnerV2) and core.config.use_v2_model_runner
    assert core.compiler.backend == "native" and [r.name for r in core.compiler.records] == ["prefill_s128",
                                                                                             "decode_b4"]
    _Spy(core.runner)
    short = [i for i, n in enumerate(LENGTHS) if n + MAX_NEW <= 128]
    prompts = [_prompts()[i] for i in short]
    assert _gen(llm, _greedy(), prompts) == [reference[i] for i in short]
    seeded = SamplingParams(temperature=1.2, top_p=0.9, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    compiled = _gen(llm, seeded, prompts)
    eager = LLM(model_dir, enforce_eager=True, **kw)
    assert isinstance(eager.llm_engine.core.runner, ModelRunnerV1)  # unset + enforce_eager selects MRv1
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    eager = LLM(model_dir, enforce_eager=True, **kw)
    assert isinstance(eager.llm_engine.core.runner, ModelRunnerV2)
    assert _gen(eager, seeded, prompts) == compiled  # in-graph noise is the same compiled or not


# -- the state pieces --------------------------------------------------------------------------------

def test_counter_uniform_is_a_deterministic_spread_of_seed_and_position():
    pos = torch.arange(20000, dtype=torch.int64)
    seed = torch.full_like(pos, fold_seed(1234))
    u = counter_uniform(seed, pos)
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert torch.equal(u, counter_uniform(seed, pos))
    hist = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float(hist.min()) > 1700 and float(hist.max()) < 2300  # ~2000 per bin
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.05  # neighbours uncorrelated
    other = counter_uniform(torch.full_like(pos, fold_seed(1235)), pos)
    assert float((other == u).float().mean()) < 0.01
    big = counter_uniform(torch.tensor([fold_seed(2**63 + 5), fold_seed(-3)]), torch.tensor([2**31 - 1, 7]))
    assert bool(((big >= 0) & (big < 1)).all())


def test_batch_state_writes_only_new_block_entries_and_reuses_slots():
    st = BatchState(max_num_seqs=2, max_blocks=4, device=torch.device("cpu"))
    a = st.join("a", SlotParams(temperature=0.5, top_k=5, top_p=0.9, seed=11))
    b = st.join("b", SlotParams())
    assert {a, b} == {0, 1} and float(st.temperature[a]) == 0.5 and int(st.seed[a]) == 11
    with pytest.raises(RuntimeError, match="no free batch slot"):
        st.join("c", SlotParams())
    assert st.sync_block_tables([("a", [3, 4]), ("b", [7])]) == 3
    assert st.sync_block_tables([("a", [3, 4]), ("b", [7])]) == 0
    assert st.sync_block_tables([("a", [3, 4, 9])]) == 1
    assert st.block_table[a].tolist() == [3, 4, 9, 0] and st.block_table[b].tolist() == [7, 0, 0, 0]
    assert st.sync_block_tables([("b", [8, 2, 5, 6, 1])]) == 4  # changed under the written prefix; clipped
    assert st.block_table[b].tolist() == [8, 2, 5, 6]
    rows = st.row_slots(["b", None, "a"], 5)
    assert rows.tolist() == [b, st.dummy, a, st.dummy, st.dummy]
    st.set_last_tokens(["a"], [42])
    assert int(st.last_token[a]) == 42
    st.leave("a")
    c = st.join("c", SlotParams())
    assert c == a and st.block_table[c].tolist() == [0, 0, 0, 0] and int(st.last_token[c]) == 0
    assert st.row_slots(["b", None, "c"], 5).tolist() == [b, st.dummy, c, st.dummy, st.dummy]


def test_batch_state_keeps_a_block_table_per_kv_cache_group():
    st = BatchState(max_num_seqs=2, max_blocks=4, device=torch.device("cpu"), num_kv_groups=2)
    a = st.join("a", SlotParams())
    assert st.sync_block_tables([("a", [3, 4])]) == 2
    assert st.sync_block_tables([("a", [5, 6, 7])], group=1) == 3  # written apart from group 0's
    assert st.block_table[a].tolist() == [3, 4, 0, 0] and st.group_tables[0][a].tolist() == [5, 6, 7, 0]
    assert st.sync_block_tables([("a", [0, 6, 7, 9])], group=1) == 1  # only the new entry; the window's null stays
    st.leave("a")
    b = st.join("b", SlotParams())
    assert b == a and st.group_tables[0][b].tolist() == [0, 0, 0, 0]
