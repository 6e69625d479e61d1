"""Which waiting prompts join a prefill step where prefill is compute-bound (core/prefill_batching.py), as the
pure rule and as the scheduler applies it."""
from __future__ import annotations

import pytest

from vllm_neuron.core.prefill_batching import CPU_STEP_OVERHEAD_TOKENS, bucket_tokens, joins_step, step_overhead_tokens
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


def _steps(overhead: int | None, prompts: list[int]) -> list[list[int]]:
    """The prompt lengths of each prefill step the scheduler runs for prompts arriving together."""
    s = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, block_size=32,
                                  num_blocks=256, prefill_buckets=BUCKETS, prefill_step_overhead_tokens=overhead))
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
