"""The data-parallel router (engine/dp_router.py): least outstanding work, prefix affinity by the
prefix cache's own block hashes, affinity yielding to load past `imbalance`, dead replicas skipped."""
from __future__ import annotations

import pytest

from vllm_neuron.core.block_hash import prompt_block_hashes
from vllm_neuron.engine.dp_router import DPRouter, choose_replica

BS = 4


def _prompt(prefix: int, n_blocks: int, tail: int = 0) -> list[int]:
    """n_blocks full blocks determined by `prefix`, then `tail` unique-ish tokens."""
    return [prefix * 1000 + i for i in range(n_blocks * BS)] + [7_000_000 + tail + i for i in range(3)]


def test_choose_least_loaded_live_replica_lowest_rank_on_ties():
    assert choose_replica([3, 1, 1], [True] * 3, None, 0, imbalance=8).replica == 1
    assert choose_replica([0, 0], [False, True], None, 0, imbalance=8).replica == 1
    with pytest.raises(RuntimeError, match="no data parallel replica is alive"):
        choose_replica([0, 0], [False, False], None, 0, imbalance=8)


def test_choose_affinity_until_imbalance_then_load():
    d = choose_replica([5, 1], [True, True], affinity=0, matched_blocks=2, imbalance=4)
    assert (d.replica, d.reason, d.matched_blocks) == (0, "prefix", 2)
    d = choose_replica([6, 1], [True, True], affinity=0, matched_blocks=2, imbalance=4)
    assert (d.replica, d.reason) == (1, "load")
    # A dead affinity replica, or no matched block, routes by load.
    assert choose_replica([0, 3], [True, False], 1, 2, 4).replica == 0
    assert choose_replica([2, 0], [True, True], 0, 0, 4).replica == 1


def test_router_balances_unrelated_prompts_and_releases_load():
    r = DPRouter(2, BS, imbalance=8)
    picks = [r.route(_prompt(p, 2)).replica for p in range(6)]
    assert picks == [0, 1, 0, 1, 0, 1] and r.loads == [3, 3]
    r.finished(0)
    r.finished(0)
    assert r.route(_prompt(99, 2)).replica == 0 and r.loads == [2, 3]


def test_prefix_sharing_requests_colocate_with_the_longest_match():
    r = DPRouter(3, BS, imbalance=8)
    first = {g: r.route(_prompt(g, 3, tail=0)).replica for g in range(3)}
    assert sorted(first.values()) == [0, 1, 2]
    for g in range(3):
        for tail in range(1, 5):  # the same 3 prefix blocks, a different ending
            d = r.route(_prompt(g, 3, tail=tail))
            assert (d.replica, d.reason, d.matched_blocks) == (first[g], "prefix", 3)
    # A prompt sharing only the first block of group 1 still finds it; the longest match wins.
    shared_one = _prompt(1, 1) + [5] * (2 * BS)
    assert r.route(shared_one).replica == first[1]


def test_affinity_yields_to_load_and_the_prefix_then_moves():
    r = DPRouter(2, BS, imbalance=2)
    home = r.route(_prompt(1, 2)).replica
    for t in range(1, 3):
        assert r.route(_prompt(1, 2, tail=t)).replica == home
    assert r.loads[home] == 3 and r.loads[1 - home] == 0
    d = r.route(_prompt(1, 2, tail=9))  # 3 - 0 > imbalance 2
    assert (d.replica, d.reason) == (1 - home, "load")
    # The newest placement owns the blocks now.
    r.finished(home, 3)
    assert r.route(_prompt(1, 2, tail=10)).replica == 1 - home


def test_uses_the_prefix_caches_block_hashes():
    r = DPRouter(2, BS, imbalance=8)
    ids = _prompt(3, 2)
    rep = r.route(ids).replica
    for h in prompt_block_hashes(ids, BS):
        assert r._owner[h] == rep
    # A partial last block is not hashed (the prefix cache keeps full blocks only).
    assert len(r._owner) == len(ids) // BS


def test_dead_replica_takes_nothing_and_forgets_its_prefixes():
    r = DPRouter(2, BS, imbalance=8)
    home = r.route(_prompt(5, 2)).replica
    r.mark_dead(home)
    d = r.route(_prompt(5, 2, tail=1))
    assert (d.replica, d.reason) == (1 - home, "load")
    assert r.loads[home] == 0


def test_weight_counts_n_completions_and_the_table_is_bounded():
    r = DPRouter(2, BS, imbalance=100, max_blocks=5)
    r.route(_prompt(1, 2), weight=4)
    assert r.loads == [4, 0] and r.routed == [4, 0]
    for p in range(2, 6):
        r.route(_prompt(p, 2))
    assert len(r._owner) == 5


def test_replica_placements_split_threads_and_gpus():
    from vllm_neuron.engine.replica import plan_placements

    cpu = plan_placements(range(2), on_cuda=False, cuda_count=0, cpu_threads=2)
    assert [(p.rank, p.num_threads, p.cuda_index, p.kv_budget_shared_by) for p in cpu] == [(0, 1, None, 2),
                                                                                         (1, 1, None, 2)]
    assert plan_placements(range(1), on_cuda=False, cuda_count=0, cpu_threads=8)[0].num_threads is None
    assert [p.num_threads for p in plan_placements(range(2, 5), on_cuda=False, cuda_count=0, cpu_threads=2)] == [1] * 3
    assert [p.num_threads for p in plan_placements(range(2), on_cuda=False, cuda_count=0, cpu_threads=16,
                                                   tensor_parallel_size=2)] == [4, 4]
    gpu = plan_placements(range(3), on_cuda=True, cuda_count=2, cpu_threads=8)
    assert [(p.cuda_index, p.kv_budget_shared_by) for p in gpu] == [(0, 2), (1, 2), (0, 2)]
    assert plan_placements(range(0), on_cuda=False, cuda_count=0, cpu_threads=2) == []
    with pytest.raises(ValueError, match="at least one visible GPU"):
        plan_placements(range(1), on_cuda=True, cuda_count=0, cpu_threads=2)


def test_a_node_whose_ranks_do_not_fit_is_refused():
    from vllm_neuron.engine.core_client import CoreClient, Replica

    head = CoreClient.__new__(CoreClient)
    head.replicas = [Replica(0, proc=object()), Replica(1), Replica(2, node=b"node-2")]
    fits = {"size": 3, "ranks": [1]}
    assert head._node_problem(b"node-1", fits) is None
    assert "--data-parallel-size 4, the head with 3" in head._node_problem(b"node-1", {"size": 4, "ranks": [1]})
    assert "rank 0 runs on the head" in head._node_problem(b"node-0", {"size": 3, "ranks": [0]})
    assert "rank 3 is outside 0..2" in head._node_problem(b"node-3", {"size": 3, "ranks": [3]})
    assert "belongs to node node-2" in head._node_problem(b"node-1", {"size": 3, "ranks": [1, 2]})
    assert head._node_problem(b"node-2", {"size": 3, "ranks": [2]}) is None  # the same node again


def test_remote_node_samples_merge_into_the_exposition(monkeypatch):
    from prometheus_client.core import GaugeMetricFamily

    from vllm_neuron import metrics

    class LocalOnly:  # this host's samples, without touching the session's metrics folder
        def __init__(self, registry, path):
            if registry is not None:
                registry.register(self)

        def collect(self):
            fam = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=["engine", "model_name"])
            fam.add_metric(["0", "m"], 1.0)
            return [fam]

    monkeypatch.setattr(metrics.multiprocess, "MultiProcessCollector", LocalOnly)
    remote = ('# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
              '# TYPE vllm:num_requests_running gauge\n'
              'vllm:num_requests_running{engine="7",model_name="m"} 3.0\n'
              '# HELP vllm_neuron:remote_only_total A family only the node has.\n'
              '# TYPE vllm_neuron:remote_only_total counter\n'
              'vllm_neuron:remote_only_total{engine="7"} 2.0\n')
    try:
        metrics.set_remote_samples("node-7", remote)
        text = metrics.metrics_response_body().decode()
        assert 'vllm:num_requests_running{engine="7",model_name="m"} 3.0' in text
        assert 'vllm:num_requests_running{engine="0",model_name="m"} 1.0' in text
        assert text.count("# TYPE vllm:num_requests_running gauge") == 1  # one family, both samples
        assert 'vllm_neuron:remote_only_total{engine="7"} 2.0' in text
    finally:
        metrics.set_remote_samples("node-7", None)
    text = metrics.metrics_response_body().decode()
    assert 'engine="7"' not in text and 'engine="0"' in text
