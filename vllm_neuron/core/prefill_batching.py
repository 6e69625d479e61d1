"""Whether a waiting prompt joins the prefill step being formed or starts the next one (pure functions).

Where prefill is compute-bound (CPU: a step's time grows with its bucket's tokens from the smallest bucket on),
putting several prompts in one step buys little, since the step costs about what separate steps would, and it
costs time to first token: every prompt of the step waits for all of them. Four 32-token suffixes arriving
together (P3: a cached prefix plus a question) got their first tokens after one 128-token step, 78 ms each;
one step apiece gives 23, 47, 70 and 93 ms, a mean of 58.

The step's cost is modelled as its bucket's tokens plus a fixed overhead in token equivalents (the host work and
the small ops of a step: ~8 tokens on the bundled model, from the prefill buckets' step times, 2-core EPYC).
Joining adds `delay` = cost(bucket(T + n)) - cost(bucket(T)) to the m prompts already in the step; not joining
makes the prompt and the w prompts queued behind it wait for one more step, and joining saves them
`saving` = cost(bucket(T)) + cost(bucket(n)) - cost(bucket(T + n)). The prompt joins where m * delay <=
(1 + w) * saving: small prompts fill the padding of the bucket the step needs anyway (delay 0), and a long
queue is served in full steps, while a few prompts that fill buckets of their own go one step each.
Where prefill is not compute-bound (CUDA: a step's time hardly grows with its tokens) every prompt joins.

The same cost splits a prompt that no request behind could join (`first_segment`): a step of 160 tokens pads to the
256 bucket (264 with the overhead), while steps of 128 and 32 cost 176 - the 96 padded tokens were a third
of the step. The prompt's rest runs in the next prefill step (see the scheduler's policy), reading the first
segment's KV through the block tables. Prompts of 32-256 tokens cost 13% less prefill this way (uniform
lengths, buckets 32-512), a 257-token prompt 42% less.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

# A prefill step's fixed cost in tokens of its bucket, where prefill is compute-bound (CPU). The bundled model's
# steps on a 2-core EPYC: 32 tokens 23.3 ms, 64 42.3, 128 78.2, 256 155.5, 512 318.5 (0.61 ms a token, 3.6 ms
# beside), plus the host's ~1 ms a step.
CPU_STEP_OVERHEAD_TOKENS = 8


def step_overhead_tokens(device_type: str) -> int | None:
    """The overhead to model a prefill step with on this device; None where prefill is not compute-bound at
    the buckets' sizes (every prompt then joins)."""
    return CPU_STEP_OVERHEAD_TOKENS if device_type == "cpu" else None


def bucket_tokens(tokens: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `tokens` (the tokens themselves past the largest)."""
    return next((b for b in buckets if b >= tokens), tokens)


def joins_step(step_tokens: int, step_prompts: int, tokens: int, queued_after: int, buckets: Sequence[int],
               overhead_tokens: int | None) -> bool:
    """Whether a prompt chunk of `tokens` joins a prefill step that holds `step_prompts` chunks of
    `step_tokens` tokens, with `queued_after` prompts waiting behind it (see the module's docstring)."""
    if overhead_tokens is None or step_prompts == 0:
        return True

    def cost(t: int) -> int:
        return bucket_tokens(t, buckets) + overhead_tokens

    delay = cost(step_tokens + tokens) - cost(step_tokens)
    saving = cost(step_tokens) + cost(tokens) - cost(step_tokens + tokens)
    return step_prompts * delay <= (1 + queued_after) * saving


@functools.lru_cache(maxsize=8)
def _own_steps_cost(buckets: tuple[int, ...], overhead_tokens: int) -> tuple[int, ...]:
    """cost[t]: the least cost of prefilling t tokens in steps of their own, up to the largest bucket. A step
    takes a bucket's worth (no padding) or the rest (padded to its bucket); bottom-up, so no recursion."""
    cost = [0] * (buckets[-1] + 1)
    for t in range(1, len(cost)):
        best = bucket_tokens(t, buckets) + overhead_tokens
        for b in buckets:
            if b >= t:
                break
            best = min(best, b + overhead_tokens + cost[t - b])
        cost[t] = best
    return tuple(cost)


def first_segment(step_tokens: int, tokens: int, buckets: Sequence[int], overhead_tokens: int | None) -> int:
    """How many of a prompt's `tokens` (the rest of it, all of which the step could take) go in a prefill step
    holding `step_tokens` tokens, where no request behind the prompt could join the step: the first segment of
    the cheapest split of it over steps, each step costing its bucket plus the overhead (module docstring).
    A cut fills the step to a bucket exactly, and must save more than one step's overhead (the cost model's
    least certain part) over taking the whole rest; among equal cuts the largest goes first."""
    if overhead_tokens is None or not buckets or step_tokens + tokens > buckets[-1]:
        return tokens
    rest_cost = _own_steps_cost(tuple(buckets), overhead_tokens)
    here = bucket_tokens(step_tokens, buckets) + overhead_tokens if step_tokens else 0

    def cost(s: int) -> int:  # this step's added cost, then the rest in steps of its own
        return bucket_tokens(step_tokens + s, buckets) + overhead_tokens - here + rest_cost[tokens - s]

    best, best_cost = tokens, cost(tokens) - overhead_tokens
    for b in sorted(buckets, reverse=True):
        s = b - step_tokens
        if 0 < s < tokens and cost(s) < best_cost:
            best, best_cost = s, cost(s)
    return best
