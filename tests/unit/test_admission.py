"""Admission control (--max-num-queued-reqs): the bound, tickets given back once, Retry-After, the resolved
default."""
from __future__ import annotations

import gc

import pytest

from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import ModelFacts, resolve
from vllm_neuron.engine.admission import MAX_RETRY_AFTER_S, AdmissionControl
from vllm_neuron.engine.protocol import EngineOverloadedError


def test_bound_weights_and_release():
    changes = []
    control = AdmissionControl(4, lambda admitted, reason: changes.append((admitted, reason)))
    a = control.admit(3)  # n=3
    b = control.admit(1)
    with pytest.raises(EngineOverloadedError, match="4 requests are running or waiting") as e:
        control.admit(1)
    assert e.value.retry_after_s >= 1 and e.value.reason == "queue_full" and control.rejected == 1
    a.release()
    a.release()  # given back once only
    assert control.admitted == 1
    c = control.admit(3)
    b.release()
    c.release()
    assert control.admitted == 0
    assert changes == [(3, None), (4, None), (4, "queue_full"), (1, None), (4, None), (3, None), (0, None)]


def test_a_request_larger_than_the_bound_is_a_client_error():
    with pytest.raises(ValueError, match="asks for 5 completions"):
        AdmissionControl(4).admit(5)


def test_zero_is_no_bound():
    control = AdmissionControl(0)
    tickets = [control.admit(64) for _ in range(100)]
    assert control.admitted == 6400
    for t in tickets:
        t.release()


def test_a_dropped_ticket_is_given_back():
    control = AdmissionControl(1)
    control.admit(1)  # never released by its holder (a stream whose body never started)
    gc.collect()
    control.admit(1).release()


def test_retry_after_follows_the_finishing_rate(monkeypatch):
    from vllm_neuron.engine import admission

    now = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    control = AdmissionControl(1)
    for _ in range(4):  # one request finishes every 5 s
        control.admit(1).release()
        now[0] += 5.0
    held = control.admit(1)
    with pytest.raises(EngineOverloadedError) as e:
        control.admit(1)
    assert e.value.retry_after_s == 5
    now[0] += 10_000
    with pytest.raises(EngineOverloadedError) as e:
        control.admit(1)
    assert e.value.retry_after_s == MAX_RETRY_AFTER_S
    held.release()


def test_resolved_default_and_refusals():
    def resolved(**kwargs):
        return resolve(EngineArgs.from_kwargs(**kwargs), ModelFacts(2048)).max_num_queued_reqs

    assert resolved(max_num_seqs=4) == 64
    assert resolved(max_num_seqs=4, max_num_queued_reqs=0) == 0
    assert resolved(max_num_queued_reqs=7) == 7
    with pytest.raises(ValueError, match="max_num_queued_reqs must be a non-negative integer"):
        EngineArgs.from_kwargs(max_num_queued_reqs=-1)
