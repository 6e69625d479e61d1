"""Data parallelism in the engine client: AsyncLLM with data_parallel_size=2 on a tiny fp32 Llama.

32 concurrent requests in 4 prefix-sharing groups all complete on both replicas, each group on one
replica, with the greedy tokens of a single in-process engine. Then one replica is killed mid-request:
its requests fail with an error naming it, health reports it, and the survivor keeps serving. The
offline LLM(data_parallel_size=2) gives one engine's outputs, and a replica that hangs (SIGSTOP) is
found by its silence, killed, and fails its request instead of hanging it. DP=2 x TP=2 (two replicas of two
ranks each) gives one engine's greedy tokens too.
"""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from tests.integration.server_utils import rank_children
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.engine.async_llm import AsyncLLM
from vllm_neuron.engine.protocol import EngineDeadError
from vllm_neuron.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.engine

OPTS = dict(enforce_eager=True, max_model_len=256, max_num_seqs=8, dtype="float32", num_gpu_blocks_override=96,
            block_size=16)
GROUPS, PER_GROUP, MAX_TOKENS = 4, 8, 6


def _prompts() -> list[tuple[int, list[int]]]:
    """(group, prompt ids): each group shares a 48-token (3-block) prefix and ends differently."""
    out = []
    for i in range(PER_GROUP):
        for g in range(GROUPS):  # interleaved, as concurrent clients would arrive
            prefix = [(37 * g + 11 * k) % 500 + 3 for k in range(48)]
            out.append((g, prefix + [600 + i, 700 + g, 800 + i]))
    return out


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


_LOOP = asyncio.new_event_loop()  # one loop for the module: the engine's output task lives in it


@pytest.fixture(scope="module")
def dp_engine(tiny_llama_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(model=tiny_llama_dir, data_parallel_size=2, **OPTS))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def single(tiny_llama_dir):
    """One in-process engine with the same options: the reference outputs."""
    from vllm_neuron import LLM

    return LLM(tiny_llama_dir, **OPTS)


def _run(coro):
    return _LOOP.run_until_complete(coro)


async def _one(llm: AsyncLLM, rid: str, ids: list[int], params: SamplingParams, seen: dict):
    final = None
    async for out in llm.generate({"prompt_token_ids": ids}, params, rid):
        seen.setdefault(rid, llm.replica_of(rid))
        final = out
    return final


def test_dp2_serves_32_concurrent_requests_colocated_with_dp1_tokens(dp_engine, single):
    prompts = _prompts()

    async def main():
        await dp_engine.wait_until_ready(timeout=300)
        seen: dict = {}
        outs = await asyncio.gather(*(_one(dp_engine, f"r{i}", ids, _greedy(), seen)
                                      for i, (_, ids) in enumerate(prompts)))
        return outs, seen

    outs, seen = _run(main())
    assert all(o is not None and o.finished for o in outs)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    replicas = {seen[f"r{i}"] for i in range(len(prompts))}
    assert replicas == {0, 1}, f"both replicas must serve: {seen}"
    for g in range(GROUPS):
        placed = {seen[f"r{i}"] for i, (grp, _) in enumerate(prompts) if grp == g}
        assert len(placed) == 1, f"prefix group {g} was split over replicas {placed}"
    assert dp_engine.router.loads == [0, 0]  # every request's work was released
    # The host's cores are split between the replicas (2 cores, 2 replicas: 1 thread each).
    share = max(1, torch.get_num_threads() // 2)
    assert [r.info["threads"] for r in dp_engine.cores.replicas] == [share, share]

    # Greedy tokens are those of one engine (DP changes where a request runs, never what it computes).
    want = single.generate([{"prompt_token_ids": ids} for _, ids in prompts], _greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in want]


def test_a_disconnected_client_aborts_on_the_replica_serving_it(dp_engine):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    sent: list = []
    real_send = dp_engine.cores.send

    def spy(rank, msg):
        sent.append((rank, msg[0], msg[1] if msg[0] == "abort" else msg[1].request_id))
        return real_send(rank, msg)

    async def leave_after_first_token(rid: str, ids: list[int]) -> int:
        stream = dp_engine.generate({"prompt_token_ids": ids}, long, rid)
        await stream.__anext__()
        rank = dp_engine.replica_of(rid)
        await stream.aclose()  # what the HTTP layer does when the client goes away
        return rank

    async def main():
        await dp_engine.wait_until_ready(timeout=300)
        return await asyncio.gather(leave_after_first_token("a0", [21, 22, 23]),
                                    leave_after_first_token("a1", [31, 32, 33]))

    dp_engine.cores.send = spy
    try:
        ranks = _run(main())
    finally:
        dp_engine.cores.send = real_send
    assert sorted(ranks) == [0, 1]
    for rid, rank in zip(("a0", "a1"), ranks):
        assert (rank, "add", rid) in sent and (rank, "abort", [rid]) in sent
        assert (1 - rank, "abort", [rid]) not in sent
    assert dp_engine.router.loads == [0, 0]


def test_killed_replica_fails_its_requests_and_health_while_the_other_serves(dp_engine):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        await dp_engine.wait_until_ready(timeout=300)
        seen: dict = {}
        tasks = [asyncio.ensure_future(_one(dp_engine, f"k{i}", [5 + i, 9, 13 + 2 * i], long, seen))
                 for i in range(4)]
        while len(seen) < 4:  # every request has its first token
            await asyncio.sleep(0.05)
        victim = dp_engine.cores.replicas[1].proc
        os.kill(victim.pid, signal.SIGKILL)
        on_victim = [i for i in range(4) if seen[f"k{i}"] == 1]
        # Its requests fail at once; the others are still decoding their 200 tokens on replica 0.
        failed = await asyncio.wait_for(asyncio.gather(*(tasks[i] for i in on_victim), return_exceptions=True),
                                        timeout=30)
        with pytest.raises(EngineDeadError, match="data parallel replica 1 died"):
            await dp_engine.check_health()
        assert dp_engine.is_ready and not dp_engine.errored  # replica 0 still serves
        after = await _one(dp_engine, "after", [3, 4, 5], _greedy(), {})
        survivors = [tasks[i] for i in range(4) if i not in on_victim]
        survivor_errors = [t.exception() for t in survivors if t.done()]  # finished ones: no error
        for t in survivors:
            t.cancel()  # aborts them on replica 0
        await asyncio.gather(*survivors, return_exceptions=True)
        return on_victim, failed, after, survivor_errors

    on_victim, failed, after, survivor_errors = _run(main())
    assert on_victim and len(on_victim) < 4
    for res in failed:
        assert isinstance(res, EngineDeadError) and "data parallel replica 1 died" in str(res), res
    assert survivor_errors == [None] * len(survivor_errors)
    assert dp_engine.router.loads == [0, 0]
    assert after.finished and len(after.outputs[0].token_ids) == MAX_TOKENS


def test_offline_llm_data_parallel_matches_one_engine(tiny_llama_dir, single):
    from vllm_neuron import LLM

    prompts = [{"prompt_token_ids": ids} for _, ids in _prompts()[:8]] + ["Hello there", "One two three"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(tiny_llama_dir, data_parallel_size=2, **OPTS)
    got = llm.generate(prompts, params, use_tqdm=False)
    client = llm._dp.client
    assert client.router.routed[0] > 0 and client.router.routed[1] > 0
    chat = [{"role": "user", "content": "Say hi"}]
    assert [o.outputs[0].token_ids for o in llm.chat(chat, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in single.chat(chat, params, use_tqdm=False)]

    # A replica that hangs (stopped) is found by its silence, killed, and its request fails; no hang.
    # VLLM_ENGINE_ITERATION_TIMEOUT_S; long enough that the busy replica 0 is never mistaken for hung on a loaded machine.
    client.cores.iteration_timeout = 10.0
    hung = client.cores.replicas[1].proc
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        with pytest.raises(EngineDeadError, match="data parallel replica 1 died: it made no progress for"):
            llm.generate(["a", "b", "c", "d"], params, use_tqdm=False)
        hung.join(10)
        assert hung.exitcode == -signal.SIGKILL
    finally:
        if hung.is_alive():
            os.kill(hung.pid, signal.SIGKILL)
    assert len(llm.generate(["e", "f"], params, use_tqdm=False)) == 2  # replica 0 serves on
    del llm
    want = single.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]


def test_offline_llm_data_parallel_of_tensor_parallel_replicas_matches_one_engine(tiny_llama_dir, single):
    """--data-parallel-size 2 --tensor-parallel-size 2: each replica drives its own two-rank group (its rank 1
    a child process of its own); requests reach both replicas and get one unsharded engine's greedy tokens."""
    from vllm_neuron import LLM

    prompts = [{"prompt_token_ids": ids} for _, ids in _prompts()[:8]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(tiny_llama_dir, data_parallel_size=2, tensor_parallel_size=2, **OPTS)
    try:
        client = llm._dp.client
        followers = [rank_children(r.proc.pid) for r in client.cores.replicas]
        got = llm.generate(prompts, params, use_tqdm=False)
        assert client.router.routed[0] > 0 and client.router.routed[1] > 0
    finally:
        llm._dp.shutdown()
    assert [len(f) for f in followers] == [1, 1], f"one rank-1 process per replica expected: {followers}"
    want = single.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
