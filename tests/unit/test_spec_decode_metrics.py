"""vllm:spec_decode_* counters: the scheduler's cumulative counts become per-step increments, and the
exposed series read back into the figures `bench serve` prints."""
from __future__ import annotations

from vllm_neuron import metrics
from vllm_neuron.benchmarks.spec_decode_metrics import parse_spec_decode_counters
from vllm_neuron.core.spec_decode_stats import SpecDecodeStats
from vllm_neuron.engine.core_proc import _StatsRecorder
from vllm_neuron.engine.messages import SchedulerStats


class _Fake:
    def __init__(self) -> None:
        self.spec = []

    def record_step(self, **kw) -> None:
        pass

    def record_spec_decode(self, *args) -> None:
        self.spec.append(args)

    def engine_process(self) -> str:
        return "engine_0"

    def record_grammar_cache(self, *args) -> None:
        pass

    def record_grammar_timeout(self, *args) -> None:
        pass


def test_stats_recorder_turns_cumulative_counts_into_increments():
    st = SpecDecodeStats(3)
    fake = _Fake()
    rec = _StatsRecorder(fake)
    st.record(3, 2)
    rec.record(SchedulerStats(spec_decode=st.cumulative()))
    st.record(3, 3)
    st.record(1, 0)
    rec.record(SchedulerStats(spec_decode=st.cumulative()))
    rec.record(SchedulerStats())  # no speculation: nothing recorded
    assert fake.spec == [(1, 3, 2, [1, 1, 0]), (2, 4, 3, [1, 1, 1])]
    assert st.acceptance_rate == 5 / 7 and st.mean_accepted_length == 1 + 5 / 3
    assert SpecDecodeStats(0).cumulative() is None


def test_exposed_series_read_back():
    metrics.configure("spec-test")
    before = parse_spec_decode_counters(metrics.metrics_response_body().decode()) or None
    metrics.record_spec_decode(4, 12, 9, [4, 3, 2])
    text = metrics.metrics_response_body().decode()
    for name in metrics.SPEC_DECODE_SERIES:
        assert name in text
    after = parse_spec_decode_counters(text)
    run = after.minus(before) if before else after
    assert (run.num_drafts, run.num_draft_tokens, run.num_accepted_tokens) == (4, 12, 9)
    assert run.accepted_per_pos == {0: 4, 1: 3, 2: 2}
    assert run.acceptance_rate == 0.75 and run.acceptance_length == 1 + 9 / 4
    assert parse_spec_decode_counters("# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total 3\n") is None
