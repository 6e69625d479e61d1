"""Which waiting prompts join a prefill step where prefill is compute-bound (core/prefill_batching.py), as the
pure rule and as the scheduler applies it."""
from __future__ import annotations

import pytest

from vllm_neuron.core.prefill_batching import (CPU_STEP_OVERHEAD_TOKENS, bucket_tokens, first_segment, joins_step,
                                               step_overhead_tokens)
from vllm_neuron.core.scheduler import Scheduler, SchedulerConfig
from vllm_neuron.core.request import Request
from vllm_neuron.sampling_params import SamplingParams

BUCKETS = (32, 64, 128, 256, 512)
CPU = CPU_STEP_OVERHEAD_TOKENS


def test_bucket_tokens():
    assert [bucket_tokens(t, BUCKETS) for t in (1, 32, 33, 500, 512, 600)] == [32, 32, 64, 512, 512, 600]


@pytest.mark.parametrize("step, prompts, tokens, after, joins", [
    (32, 1, 32, 2, False),    # four 32-token suffixes arriving together: one step each
    (32, 1, 32, 20, True),    # a long queue behind them: full steps serve it sooner
    (256, 1, 256, 14, False),  # prompts that fill buckets of their own
    (10, 1, 10, 0, True),     # the padding of the bucket the step needs anyway
    (30, 3, 10, 96, True),    # many tiny prompts: steps of many
    (30, 3, 10, 2, False),
    (100, 1, 28, 0, True),    # still the 128 bucket
])
def test_joins_where_the_mean_time_to_first_token_drops(step, prompts, tokens, after, joins):
    assert joins_step(step, prompts, tokens, after, BUCKETS, CPU) is joins


def test_off_the_cpu_and_for_a_step_s_first_prompt_everything_joins():
    assert step_overhead_tokens("cpu") == CPU and step_overhead_tokens("cuda") is None
    assert joins_step(256, 1, 256, 0, BUCKETS, None)
    assert joins_step(0, 0, 512, 0, BUCKETS, CPU)


@pytest.mark.parametrize("step, tokens, first", [
    (0, 160, 128),   # 128 + 32 (176) rather than one 256 step (264)
    (0, 257, 256),   # 256 + 1 (in a 32 step) rather than 512
    (0, 200, 128),   # 128 + 64 + 32 (248) against 264: saves more than a step's overhead
    (0, 65, 64),     # 64 + 32 or 32 + 64 cost the same: the larger first
    (0, 480, 480),   # 256 + 128 + 64 + 32 would save one overhead only: not enough
    (0, 100, 100),   # 64 + 64 pads more than 128 does
    (0, 250, 250), (0, 32, 32), (0, 33, 33), (0, 512, 512),
    (100, 100, 28),  # fills the 128 bucket the step needs anyway; 72 go on in a step of their own
    (0, 600, 600),   # past the largest bucket: the budget cuts it, not this
])
def test_first_segment_is_the_start_of_the_cheapest_split(step, tokens, first):
    assert first_segment(step, tokens, BUCKETS, CPU) == first
    assert first_segment(step, tokens, BUCKETS, None) == tokens  # not compute-bound: never split


def _model_cost(segments: list[int]) -> int:
    return sum(bucket_tokens(n, BUCKETS) + CPU for n in segments)


@pytest.mark.parametrize("tokens", range(1, 513))
def test_splitting_step_by_step_never_costs_more_than_one_step(tokens):
    """Every length: the segments first_segment hands out one step at a time cover the prompt exactly, and
    the model's cost of them is never above the unsplit step's."""
    segments, left = [], tokens
    while left:
        segments.append(first_segment(0, left, BUCKETS, CPU))
        left -= segments[-1]
    assert sum(segments) == tokens and all(s > 0 for s in segments)
    assert _model_cost(segments) <= _model_cost([tokens])


def _steps(overhead: int | None, prompts: list[int], split: bool = False) -> list[list[int]]:
    """The prompt lengths of each prefill step the scheduler runs for prompts arriving together."""
    s = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, block_size=32,
                                  num_blocks=256, prefill_buckets=BUCKETS, prefill_step_overhead_tokens=overhead,
                                  split_prompts_at_buckets=split))
    for i, n in enumerate(prompts):
        s.add_request(Request(f"r{i}", [10 + (i * 997 + j) % 4000 for j in range(n)], SamplingParams(max_tokens=1)))
    steps = []
    while (out := s._schedule_prefill()) is not None:
        steps.append([len(c.token_ids) for c in out.chunks])
    return steps


def test_the_scheduler_splits_a_few_compute_bound_prompts_and_keeps_batching_elsewhere():
    assert _steps(CPU, [32] * 4) == [[32], [32], [32], [32]]
    assert _steps(None, [32] * 4) == [[32] * 4]  # CUDA: one step
    assert _steps(CPU, [10] * 3) == [[10] * 3]  # they share the 32-token bucket
    assert _steps(CPU, [600, 32]) == [[512], [88, 32]]  # the rest of a long prompt, then one that fills padding


def test_the_scheduler_splits_the_last_prompt_at_a_bucket_where_that_pays():
    assert _steps(CPU, [160], split=True) == [[128], [32]]
    assert _steps(CPU, [160], split=False) == [[160]]  # where later segments would need context graphs
    assert _steps(CPU, [250], split=True) == [[250]]
    # Only the prompt that no request behind could join: the others' padding may be filled by those behind them.
    assert _steps(CPU, [600, 32], split=True) == [[512], [88, 32]]
    assert _steps(CPU, [100, 100], split=True) == [[100, 28], [64], [8]]  # 72 alone: 64 + 32 beats 128


def test_a_split_prompt_is_prefilled_exactly_once_and_samples_at_its_end():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024, block_size=16,
                                  num_blocks=64, prefill_buckets=BUCKETS, prefill_step_overhead_tokens=CPU,
                                  split_prompts_at_buckets=True))
    prompt = [(7 * j) % 3000 + 5 for j in range(200)]
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
    seen, samples = [], []
    while (out := s._schedule_prefill()) is not None:
        (c,) = out.chunks
        assert c.start_pos == len(seen)
        seen += c.token_ids
        samples.append(c.sample)
    assert seen == prompt and samples == [False, False, True]


def test_a_prompt_is_split_when_those_waiting_behind_it_have_no_seat():
    """A prompt taking the last free seat has the queue behind it, none of which can join: it is split."""
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512, max_model_len=1024, block_size=16,
                                  num_blocks=64, prefill_buckets=BUCKETS, prefill_step_overhead_tokens=CPU,
                                  split_prompts_at_buckets=True))
    for i in range(2):
        s.add_request(Request(f"r{i}", [5 + i + j for j in range(160)], SamplingParams(max_tokens=4)))
    steps = []
    while (out := s._schedule_prefill()) is not None:
        steps.append([(c.req_id, len(c.token_ids)) for c in out.chunks])
    assert steps == [[("r0", 128)], [("r0", 32)]]  # r1 waits for the seat
