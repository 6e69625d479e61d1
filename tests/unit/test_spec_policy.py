"""The speculation policy (core/spec_policy.py): a request whose drafts are mostly rejected pauses, probes
with doubling pauses, resumes on a good probe; vLLM's disable_by_batch_size."""
from __future__ import annotations

from vllm_neuron.core.spec_policy import SpecPolicy


def _steps_without_drafts(p: SpecPolicy, rid: str) -> int:
    """Decode steps until the request may carry drafts again (take_step each, as the scheduler does)."""
    n = 0
    while not p.take_step(rid):
        n += 1
        # The step that ends the pause already lets the runner propose for the next one.
        assert p.wants_drafts_next(rid) == (p._req[rid].paused == 0)
    return n


def test_low_acceptance_pauses_then_probes_with_doubling_pauses():
    p = SpecPolicy(min_acceptance=0.25, window=4, initial_backoff=3, max_backoff=10)
    for _ in range(3):
        assert not p.record("a", 4, 0) and p.take_step("a")
    assert p.record("a", 4, 0)  # the 4th bad round in the window
    assert p.is_paused("a") and not p.wants_drafts_next("a")
    assert _steps_without_drafts(p, "a") == 3
    assert p.record("a", 4, 0)  # a bad probe: paused again, twice as long
    assert _steps_without_drafts(p, "a") == 6
    assert p.record("a", 4, 0) and _steps_without_drafts(p, "a") == 10  # capped
    assert p.num_pauses == 3 and p.num_resumes == 0


def test_a_good_probe_resumes_and_resets_the_backoff():
    p = SpecPolicy(min_acceptance=0.25, window=2, initial_backoff=2, max_backoff=64)
    p.record("a", 4, 0)
    assert p.record("a", 4, 0) and _steps_without_drafts(p, "a") == 2
    assert p.record("a", 4, 0) and _steps_without_drafts(p, "a") == 4
    assert not p.record("a", 4, 2)  # half accepted: resumed, the window restarts with the probe round
    assert not p.is_paused("a") and p.take_step("a") and p.num_resumes == 1
    assert not p.record("a", 4, 1)  # 3 of 8 in the window
    assert p.record("a", 4, 0)  # 1 of 8: paused again, for the initial pause
    assert _steps_without_drafts(p, "a") == 2


def test_acceptance_at_the_bar_keeps_speculating():
    p = SpecPolicy(min_acceptance=0.25, window=4)
    for i in range(40):
        assert not p.record("a", 4, 1)  # exactly 25%
        assert p.take_step("a")
    q = SpecPolicy(min_acceptance=0.25, window=4)
    for _ in range(40):  # short drafts (n-gram: fewer than K) that are right
        assert not q.record("a", 1, 1) and q.take_step("a")
    assert not q.record("a", 0, 0)  # a row without drafts is no round


def test_requests_are_independent_and_removed():
    p = SpecPolicy(window=1, initial_backoff=5)
    assert p.record("bad", 4, 0) and not p.record("good", 4, 4)
    assert not p.take_step("bad") and p.take_step("good") and p.take_step("new")
    p.remove("bad")
    assert p.take_step("bad") and not p.is_paused("bad")


def test_disable_by_batch_size_is_vllms_running_queue_rule():
    assert SpecPolicy().batch_allows(10_000)
    p = SpecPolicy(disable_by_batch_size=4)
    assert p.batch_allows(1) and p.batch_allows(3)
    assert not p.batch_allows(4) and not p.batch_allows(9)
