"""vLLM's built-in min_tokens, logit_bias and min_p as logits processors (worker/builtin_logits_processors.py),
driven like custom processors: a persistent batch whose requests come, go and move between steps."""
from __future__ import annotations

import torch

from vllm_neuron.logits_processor import BatchUpdate, MoveDirectionality
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.worker.builtin_logits_processors import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                          MinTokensLogitsProcessor)
from vllm_neuron.worker.logits_processors import LogitsProcessorBatch

V = 10
EOS = 9


def _params(**kw) -> SamplingParams:
    p = SamplingParams(temperature=1.0, **kw)
    p._all_stop_token_ids = [*p.stop_token_ids, EOS]  # what the worker sets
    return p


def _reference(logits: torch.Tensor, p: SamplingParams, output: list[int]) -> torch.Tensor:
    """The three options computed directly on one row."""
    x = logits.clone()
    if len(output) < p.min_tokens:
        x[p.all_stop_token_ids] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.min_p > 0:
        probs = torch.softmax(x, -1)
        x[probs < probs.max() * p.min_p] = float("-inf")
    return x


def test_builtins_follow_a_persistent_batch_through_adds_removes_and_moves():
    batch = LogitsProcessorBatch([MinTokensLogitsProcessor, LogitBiasLogitsProcessor, MinPLogitsProcessor],
                                 None, torch.device("cpu"))
    requests = {
        "a": _params(min_tokens=2, stop_token_ids=[3]),
        "b": _params(logit_bias={1: 2.5, 4: -1.0}),
        "c": _params(min_p=0.3),
        "d": _params(),
        "e": _params(min_tokens=1, logit_bias={EOS: 5.0}, min_p=0.05),
    }
    outputs: dict[str, list[int]] = {}
    gen = torch.Generator().manual_seed(0)
    live: list[str] = []
    # Step by step: who joins and who leaves (a removal moves the last request into the hole).
    plan = [(["a", "b", "c"], []), (["d"], ["a"]), (["e"], ["b"]), ([], ["c"]), ([], [])]
    changed = 0
    for joins, leaves in plan:
        for r in leaves:
            batch.remove(r)
            live.remove(r)
        for r in joins:
            outputs[r] = []
            batch.add(r, requests[r], [1, 2], outputs[r])
            live.append(r)
        logits = torch.randn(len(live), V, generator=gen)
        ids = list(reversed(live))  # rows in another order than the batch's indices
        got = batch.apply(logits.clone(), ids)
        got = batch.apply(got, ids, argmax_invariant=True)
        for row, r in enumerate(ids):
            want = _reference(logits[row], requests[r], outputs[r])
            assert torch.equal(got[row], want), (r, got[row], want)
            changed += not torch.equal(want, logits[row])
            outputs[r].append(int(got[row].argmax()))  # the live list the processors read min_tokens from
    assert changed >= 6  # the options really edited rows, steps after their requests joined included


def test_swap_moves_both_rows_state():
    p = MinTokensLogitsProcessor()
    out0: list[int] = []
    p.update_state(BatchUpdate(2, (), [(0, _params(min_tokens=1), [], out0), (1, _params(), [], [])], ()))
    p.update_state(BatchUpdate(2, (), (), [(0, 1, MoveDirectionality.SWAP)]))
    x = p.apply(torch.zeros(2, V))
    assert torch.isneginf(x[1, EOS]) and not torch.isneginf(x[0]).any()


def test_rows_without_the_option_are_left_alone():
    for cls in (MinTokensLogitsProcessor, LogitBiasLogitsProcessor, MinPLogitsProcessor):
        p = cls()
        p.update_state(BatchUpdate(1, (), [(0, _params(), [], [])], ()))
        x = torch.randn(1, V)
        assert not p.rows and torch.equal(p.apply(x.clone()), x)
    assert MinPLogitsProcessor().is_argmax_invariant() and not LogitBiasLogitsProcessor().is_argmax_invariant()


def test_batch_indices_stay_dense_and_updates_replay_in_order():
    """Random joins and leaves: replaying each BatchUpdate (removed, added, moved) on a plain dict gives the
    batch's own index of every live request, and the indices are 0..n-1."""
    import random

    rnd = random.Random(3)
    batch = LogitsProcessorBatch([], None, torch.device("cpu"))
    mirror: dict[int, str] = {}
    live: list[str] = []
    for step in range(60):
        for _ in range(rnd.randint(0, 3)):
            if live and rnd.random() < 0.5:
                r = live.pop(rnd.randrange(len(live)))
                batch.remove(r)
        for j in range(rnd.randint(0, 3)):
            r = f"r{step}.{j}"
            batch.add(r, SamplingParams(extra_args={"id": r}), [], [])
            live.append(r)
        update = batch._update()
        if update is not None:
            for i in update.removed:
                mirror.pop(i, None)
            for i, params, _, _ in update.added:
                mirror[i] = params.extra_args["id"]
            for a, b, _ in update.moved:
                mirror[b] = mirror.pop(a)
            assert update.batch_size == len(live)
        assert sorted(mirror) == list(range(len(live)))
        assert {r: batch.index[r] for r in live} == {r: i for i, r in mirror.items()}
