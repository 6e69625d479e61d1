"""The bucket advisor (config/bucket_advisor.py) against brute force on small cases, its lists against
config/buckets.py's validators, the served-shape summary (engine/served_shapes.py) and `buckets advise`'s sources
and refusals."""
from __future__ import annotations

import itertools
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_neuron.config import buckets as B
from vllm_neuron.config.bucket_advisor import (Limits, Lists, Traffic, advise, decode_options, partition_costs,
                                               validate_lists)
from vllm_neuron.config.neuron_config import parse_additional_config
from vllm_neuron.engine.served_shapes import ServedShapes, parse_summary
from vllm_neuron.entrypoints.cli import bucket_sources
from vllm_neuron.entrypoints.cli.main import main


def _subsets_ending_at(values: list[int], top: int, max_len: int):
    """Every ascending list of at most max_len buckets drawn from `values`, ending at `top`."""
    inner = sorted(set(values) - {top})
    for r in range(0, max_len):
        for combo in itertools.combinations(inner, r):
            yield (*combo, top)


def _cost_1d(buckets, values):
    return sum(w * B.select_bucket(buckets, v) for v, w in values.items())


@pytest.mark.parametrize("seed", range(12))
def test_partition_matches_brute_force(seed):
    rng = random.Random(seed)
    top = rng.choice([16, 40, 64])
    values = {rng.randint(1, top): rng.randint(1, 9) for _ in range(rng.randint(1, 7))}
    got = partition_costs(values, top, 5)
    for k, (cost, tops) in enumerate(got, 1):
        best = min(_cost_1d(b, values) for b in _subsets_ending_at(list(values), top, k))
        assert cost == pytest.approx(best), (k, values)
        assert tops[-1] == top and tops == sorted(set(tops)) and len(tops) <= k
        assert _cost_1d(tops, values) == pytest.approx(cost)  # the list achieves the cost it reports


def _decode_cost(batch, ctx, decode):
    return sum(n * B.select_bucket(batch, b) * B.select_bucket(ctx, c) for (b, c), n in decode.items())


@pytest.mark.parametrize("seed", range(8))
def test_decode_lists_match_brute_force(seed):
    rng = random.Random(100 + seed)
    limits = Limits(64, 8, 640, 16)
    decode = {(rng.randint(1, 8), rng.choice([90, 128, 200, 256, 300, 640])): rng.randint(1, 20)
              for _ in range(rng.randint(2, 8))}
    grid = {(b, limits.context_top(c)): 0 for b, c in decode}
    for budget in (1, 2, 3, 4, 6):
        opts = decode_options(decode, limits, budget)
        got = min(cost for g, (cost, _, _) in opts.items() if g <= budget)
        best = math.inf
        for ctx in _subsets_ending_at([c for _, c in grid], 640, budget):
            for batch in _subsets_ending_at(list(range(1, 9)), 8, budget // len(ctx)):
                best = min(best, _decode_cost(batch, ctx, decode))
        assert got == pytest.approx(best), (budget, decode)
        for g, (cost, batch, ctx) in opts.items():
            assert len(batch) * len(ctx) == g and _decode_cost(batch, ctx, decode) == pytest.approx(cost)


def test_advise_matches_brute_force_over_the_whole_budget():
    limits = Limits(48, 4, 512, 16)
    traffic = Traffic({5: 10, 17: 3, 30: 2, 48: 1}, {(1, 100): 30, (3, 300): 5, (4, 500): 2},
                      {"prefill": 2.0, "decode": 6.0})
    current = Lists((48,), (4,), (512,))
    p0, d0 = _cost_1d(current.prefill, traffic.prefill), _decode_cost(current.decode, current.contexts, traffic.decode)
    wp, wd = 0.25 / p0, 0.75 / d0  # seconds per unit of cost, from the measured shares
    for budget in (2, 3, 5, 7):
        advice = advise(traffic, limits, current, budget)
        best = math.inf
        for plist in _subsets_ending_at(list(traffic.prefill), 48, budget):
            for ctx in _subsets_ending_at([128, 256, 384, 512], 512, budget):
                for batch in _subsets_ending_at([1, 2, 3, 4], 4, budget):
                    if len(plist) + len(batch) * len(ctx) <= budget:
                        best = min(best, wp * _cost_1d(plist, traffic.prefill) + wd * _decode_cost(batch, ctx,
                                                                                                 traffic.decode))
        assert advice.after.expected_time == pytest.approx(best), budget
        assert advice.after.graphs <= budget
        assert advice.before.expected_time == pytest.approx(1.0)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_proposals_always_pass_the_validators(data):
    block = data.draw(st.sampled_from([16, 32, 128, 256]))
    max_model_len = data.draw(st.integers(1, 40)) * 64 + data.draw(st.integers(0, 63))
    max_seqs = data.draw(st.integers(1, 64))
    max_tokens = data.draw(st.integers(1, 4096))
    limits = Limits(max_tokens, max_seqs, max_model_len, block, prefill_graphs_per_bucket=data.draw(st.sampled_from([1, 2])),
                    decode_graphs_per_bucket=data.draw(st.sampled_from([1, 2])))
    prefill = data.draw(st.dictionaries(st.integers(1, max_tokens), st.integers(1, 50), max_size=20))
    decode = data.draw(st.dictionaries(st.tuples(st.integers(1, max_seqs), st.integers(1, max_model_len)),
                                       st.integers(1, 50), min_size=0 if prefill else 1, max_size=20))
    current = Lists(tuple(B.default_prefill_buckets(max_tokens)), tuple(B.default_decode_buckets(max_seqs)),
                    (max_model_len,))
    budget = data.draw(st.integers(limits.prefill_graphs_per_bucket + limits.decode_graphs_per_bucket, 24))
    advice = advise(Traffic(prefill, decode), limits, current, budget)
    validate_lists(advice.proposed, limits)
    nc = parse_additional_config({"neuron_config": advice.proposed.neuron_config()}).neuron_config
    nc.validate(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs, max_model_len=max_model_len,
                block_size=block)
    assert advice.after.graphs <= budget
    assert advice.after.expected_time <= advice.before.expected_time + 1e-9 or budget < advice.before.graphs


def test_bad_data_and_budgets_are_refused():
    limits = Limits(64, 4, 256, 16)
    current = Lists((64,), (4,), (256,))
    with pytest.raises(ValueError, match="no steps were recorded"):
        advise(Traffic(), limits, current)
    with pytest.raises(ValueError, match="does not fit max_num_batched_tokens=64"):
        advise(Traffic({65: 1}), limits, current)
    with pytest.raises(ValueError, match="does not fit max_num_seqs=4"):
        advise(Traffic({}, {(5, 10): 1}), limits, current)
    with pytest.raises(ValueError, match="below this engine's minimum of 2 graphs"):
        advise(Traffic({3: 1}), limits, current, max_graphs=1)


def test_summary_accumulates_across_writers_and_restarts(tmp_path):
    path = tmp_path / "served_shapes.json"
    limits, current = Limits(64, 4, 512, 16), Lists((32, 64), (1, 4), (512,))
    a = ServedShapes(path, limits, current, {"prefill": 2.0})
    b = ServedShapes(path, limits, current)
    a.record("prefill", 20, 20, 0.01)
    a.record("decode", 3, 130, 0.002)
    b.record("decode", 3, 200, 0.002)
    a.flush()
    b.flush()
    a.flush()  # nothing new: no change
    lim, traffic, cur, compile_s = parse_summary(path)
    assert lim == limits and cur == current and compile_s == {"prefill": 2.0}
    assert traffic.prefill == {20: 1} and traffic.decode == {(3, 256): 2}  # contexts on the 128 grid
    assert traffic.decode_work == 3 * 130 + 3 * 200
    other = ServedShapes(path, Limits(64, 8, 512, 16), current)  # other limits: a fresh summary
    other.record("prefill", 7, 7, 0.01)
    other.flush()
    assert parse_summary(path)[1].prefill == {7: 1}


def test_cli_advises_from_a_summary_and_refuses_malformed_input(tmp_path, capsys):
    path = tmp_path / "served_shapes.json"
    limits = Limits(256, 8, 1024, 16)
    rec = ServedShapes(path, limits, Lists((128, 256), (1, 2, 4, 8), (1024,)), {"prefill": 3.0, "decode": 2.0})
    for _ in range(20):
        rec.record("prefill", 40, 40, 0.01)
        rec.record("decode", 3, 150, 0.001)
    rec.flush()
    assert main(["buckets", "advise", "--from-summary", str(path)]) == 0
    out = capsys.readouterr().out
    config = json.loads(out.split("--additional-config '")[1].rstrip().rstrip("'"))["neuron_config"]
    assert config["num_batched_tokens_buckets"] == [40, 256] and config["num_seqs_buckets"][0] == 3
    assert "prefill padding" in out and "~" in out  # the compile estimate from the recorded times
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "limits": {}}')
    assert main(["buckets", "advise", "--from-summary", str(bad)]) == 2
    assert "not a valid served-shape summary" in capsys.readouterr().err
    bad.write_text("not json")
    assert main(["buckets", "advise", "--from-summary", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    empty = tmp_path / "empty.log"
    empty.write_text("INFO nothing here\n")
    assert main(["buckets", "advise", "--from-log", str(empty)]) == 2
    assert "no step lines" in capsys.readouterr().err


def test_log_source_reads_the_step_lines_and_the_start_up_table(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("\n".join([
        "INFO 12-05 10:00:00 [core.py:52] Engine config: model=/m device=cpu dtype=torch.float32 max_model_len=512 "
        "max_num_seqs=4 max_num_batched_tokens=64 block_size=16 prefix_caching=True sampling=on-device",
        "INFO 12-05 10:00:00 [core.py:80] " + B.format_bucket_table([32, 64], [1, 2, 4], [512]),
        "DEBUG 12-05 10:00:01 [core.py:400] step prefill_s32 tokens=20/32 context=20 execute_ms=5.000 graph_ms=4.0",
        "DEBUG 12-05 10:00:01 [core.py:400] step prefill_s32 tokens=20/32 context=20 execute_ms=5.000 graph_ms=4.0",
        "DEBUG 12-05 10:00:01 [core.py:400] step decode_b4 seqs=3/4 context=21 execute_ms=1.000 graph_ms=0.8"]))
    src = bucket_sources.from_log(str(log))
    assert src.traffic.prefill == {20: 2} and src.traffic.decode == {(3, 21): 1}
    assert src.traffic.seconds == pytest.approx({"prefill": 0.01, "decode": 0.001})
    assert src.limits == Limits(64, 4, 512, 16) and src.current == Lists((32, 64), (1, 2, 4), (512,))
    with pytest.raises(ValueError, match="give --max-num-batched-tokens N --max-num-seqs N --max-model-len N"):
        bucket_sources.with_overrides(bucket_sources.Source("log x", src.traffic, None, None, {}),
                                      max_num_batched_tokens=None, max_num_seqs=None, max_model_len=None,
                                      block_size=None)


def test_the_engine_hints_once_when_its_padding_is_far_above_the_advice(caplog):
    limits = Limits(512, 4, 1024, 16)
    served = ServedShapes(None, limits, Lists((256, 512), (1, 4), (1024,)))
    for _ in range(300):
        served.record("decode", 4, 900, 0.001)  # fits its buckets: no padding to speak of
    caplog.set_level("INFO", logger="vllm_neuron.engine.served_shapes")
    served._maybe_hint()
    assert "Bucket padding" not in caplog.text  # too few steps yet
    for _ in range(300):
        served.record("prefill", 10, 10, 0.01)  # 10 tokens in a 256 bucket
    served._maybe_hint()
    served._maybe_hint()
    lines = [r.getMessage() for r in caplog.records if "Bucket padding" in r.getMessage()]
    assert len(lines) == 1 and "prefill 96% of its compute (advised lists with as many buckets: 0%)" in lines[0]
    assert "decode" not in lines[0].split("Bucket padding:")[1].split(".")[0]


def test_an_idle_engine_writes_what_it_served_at_most_every_few_seconds(tmp_path):
    path = tmp_path / "served_shapes.json"
    served = ServedShapes(path, Limits(64, 4, 512, 16), Lists((64,), (4,), (512,)))
    served.flush_when_idle(1000.0)
    assert not path.exists()  # nothing served yet
    served.record("prefill", 9, 9, 0.01)
    served.flush_when_idle(1000.0)
    served.record("prefill", 9, 9, 0.01)
    served.flush_when_idle(1001.0)  # too soon: kept for later
    assert parse_summary(path)[1].prefill == {9: 1}
    served.flush_when_idle(1006.0)
    assert parse_summary(path)[1].prefill == {9: 2}
