"""Disaggregated prefill/decode, the pure parts: --kv-transfer-config and kv_transfer_params parsing, the
scheduler holding a prefill instance's blocks and admitting a decode instance's remote prefills, the head
split between tensor-parallel sizes, block gather/scatter, the TCP block server's checks, NIXL reads through it
(when the optional nixl package is installed), the proxy's pool."""
from __future__ import annotations

import pytest
import torch

from vllm_neuron.config import kv_transfer as kv_transfer_config
from vllm_neuron.config.kv_transfer import nixl_installed, parse_kv_transfer_config, parse_kv_transfer_params
from vllm_neuron.core.kv_transfer import KVTransferScheduler
from vllm_neuron.core.request import Request, RequestStatus
from vllm_neuron.core.scheduler import Scheduler, SchedulerConfig
from vllm_neuron.distributed.kv_transfer.block_io import gather_blocks, scatter_blocks
from vllm_neuron.distributed.kv_transfer.head_split import HeadSlice, rank_heads, read_plan
from vllm_neuron.distributed.kv_transfer.tcp import BlockClient, BlockServer, TransferError
from vllm_neuron.entrypoints.disagg.pool import InstancePool
from vllm_neuron.entrypoints.disagg.proxy import prefill_body
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.step import ModelRunnerOutput

BS = 4


# -- configuration ------------------------------------------------------------------------------------------
def test_kv_transfer_config_vllm_fields_and_errors():
    cfg = parse_kv_transfer_config('{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 15000, '
                                   '"kv_ip": "0.0.0.0", "engine_id": "p0", "kv_rank": 0, "kv_parallel_size": 2, '
                                   '"kv_buffer_device": "cpu", "kv_connector_extra_config": '
                                   '{"hold_timeout_s": 5, "advertise_host": "10.0.0.7"}}')
    assert (cfg.kv_connector, cfg.kv_role, cfg.kv_port, cfg.engine_id, cfg.hold_timeout_s) == \
        ("TcpConnector", "kv_producer", 15000, "p0", 5)
    assert cfg.is_producer and not cfg.is_consumer and cfg.host == "10.0.0.7" and cfg.port_of(0, 2, 1) == 15001
    assert parse_kv_transfer_config(None) is None and parse_kv_transfer_config("{}") is None
    both = parse_kv_transfer_config({"kv_connector": "TcpConnector", "kv_role": "kv_both"})
    assert both.is_producer and both.is_consumer and both.engine_id.startswith("vllm-neuron-")
    bad = [({"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}, "kv_connector.*TcpConnector"),
           ({"kv_connector": "TcpConnector", "kv_role": "both"}, "kv_role.*kv_producer"),
           ({"kv_connector": "TcpConnector"}, "needs kv_connector .* and kv_role"),
           ({"kv_connector": "TcpConnector", "kv_role": "kv_both", "kv_prot": 1}, r"unknown field\(s\) \['kv_prot'\]"),
           ({"kv_connector": "TcpConnector", "kv_role": "kv_both", "kv_port": 70000}, "kv_port"),
           ({"kv_connector": "TcpConnector", "kv_role": "kv_both", "kv_buffer_device": "npu"}, "kv_buffer_device"),
           ({"kv_connector": "TcpConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"hold_timeout": 1}}, "unknown key.*hold_timeout_s"),
           ("[1]", "must be a JSON object")]
    for value, match in bad:
        with pytest.raises(ValueError, match=match):
            parse_kv_transfer_config(value)


def test_nixl_connector_needs_the_nixl_package(monkeypatch):
    monkeypatch.setattr(kv_transfer_config, "nixl_installed", lambda: True)
    assert parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_both"}).kv_connector == \
        "NixlConnector"
    monkeypatch.setattr(kv_transfer_config, "nixl_installed", lambda: False)
    with pytest.raises(ValueError, match=r"'NixlConnector' needs the nixl package.*pip install nixl.*TcpConnector"):
        parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})


def test_kv_transfer_params_shape_checked():
    p = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
         "remote_host": None, "remote_port": None}
    assert parse_kv_transfer_params(p) == p and parse_kv_transfer_params(None) is None
    for value, match in [([], "must be an object"), ({"remote_port": "80"}, "remote_port must be int"),
                         ({"remote_port": 0}, "TCP port"), ({"remote_block_ids": [1, -2]}, "non-negative"),
                         ({"remote_block_ids": [[1], ["x"]]}, "block ids"), ({"do_remote_prefill": 1}, "bool")]:
        with pytest.raises(ValueError, match=match):
            parse_kv_transfer_params(value)


# -- the scheduler's side -------------------------------------------------------------------------------------
class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _sched(role: str, clock=None, num_blocks: int = 32, **kw) -> Scheduler:
    xfer = KVTransferScheduler(role=role, engine_id="e0", host="127.0.0.1", port=15000, tp_size=1, block_size=BS,
                               hold_timeout_s=10.0, clock=clock or Clock())
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=BS,
                                     num_blocks=num_blocks, **kw), xfer)


def _req(rid: str, n: int, params: dict | None, max_tokens: int = 1, first: int = 10) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                      extra_args=extra), eos_token_id=None)


def _run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update(out, ModelRunnerOutput(sampled={c.req_id: [token] for c in out.chunks if c.sample}))
    return out


def test_prefill_instance_holds_blocks_until_released_and_expires_the_rest():
    clock = Clock()
    s = _sched("kv_producer", clock)
    free0 = s.kv.num_free_blocks()
    s.add_request(_req("a", 10, {"do_remote_decode": True}))
    s.add_request(_req("b", 6, {"do_remote_decode": True}, first=50))
    s.add_request(_req("c", 6, None, first=90))  # a plain request frees its blocks at once
    _run_step(s)
    xfer = s.kv_transfer
    assert not s.has_unfinished() and set(xfer.held) == {"a", "b"}
    pa = xfer.params_out["a"]
    assert pa["do_remote_prefill"] and not pa["do_remote_decode"] and pa["remote_engine_id"] == "e0"
    assert pa["remote_host"] == "127.0.0.1" and pa["remote_port"] == 15000 and len(pa["remote_block_ids"]) == 3
    assert pa["remote_num_tokens"] == 10 and len(pa["remote_secret"]) == 32 and "c" not in xfer.params_out
    assert [h.request.request_id for h in xfer.new_holds] == ["a", "b"]
    assert s.kv.num_free_blocks() == free0 - 3 - 2 and xfer.stats.held_blocks == 5
    assert s.release_held(["a", "zz"]) == ["a"] and s.kv.num_free_blocks() == free0 - 2
    assert s.release_held(None) == [] and xfer.stats.expired == 0
    clock.t = 10.0
    assert s.release_held(None) == ["b"] and xfer.stats.expired == 1
    assert s.kv.num_free_blocks() == free0 and xfer.stats.held_blocks == 0 and not xfer.held


def test_aborted_request_is_not_held():
    s = _sched("kv_producer")
    s.add_request(_req("a", 10, {"do_remote_decode": True}, max_tokens=4))
    s.schedule()
    s.finish_request("a", "abort")
    assert not s.kv_transfer.held and s.kv.num_free_blocks() == 31


def _remote(n_tokens: int, blocks: list[int]) -> dict:
    return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 15000, "remote_engine_id": "p0",
            "remote_request_id": "r", "remote_block_ids": blocks, "remote_secret": "s", "tp_size": 1,
            "remote_num_tokens": n_tokens}


def test_decode_instance_reads_all_but_the_last_token_then_prefills_one():
    s2 = _sched("kv_consumer")
    s2.add_request(_req("a", 10, _remote(10, [5, 6, 7]), max_tokens=3))
    jobs = s2.take_kv_loads()
    assert len(jobs) == 1 and jobs[0].num_tokens == 9 and jobs[0].engine_id == "p0"
    (remote, local), = jobs[0].groups
    assert remote == [5, 6, 7] and local == s2.kv.block_table("a")[:3]  # tokens 0..8: 3 blocks of 4
    assert s2.kv_transfer.is_loading("a") and s2.schedule() is None  # no step while its blocks are being written
    assert s2.take_kv_loads() == []  # admitted once
    s2.finish_kv_load("a", True)
    out = s2.schedule()
    (chunk,) = out.chunks
    assert out.kind == "prefill" and chunk.start_pos == 9 and chunk.token_ids == [19] and chunk.sample
    assert [d.req_id for d in out.new_requests] == ["a"] and s2.kv_transfer.stats.loads == 1


def test_failed_read_prefills_locally_and_is_counted():
    s = _sched("kv_consumer")
    s.add_request(_req("a", 10, _remote(10, [5, 6, 7])))
    s.take_kv_loads()
    s.finish_kv_load("a", False)
    out = s.schedule()
    assert out.chunks[0].start_pos == 0 and len(out.chunks[0].token_ids) == 10
    assert s.kv_transfer.stats.recomputed == 1 and s.kv_transfer.stats.loads == 0


def test_decode_side_prefix_hit_reads_fewer_blocks():
    s = _sched("kv_consumer", enable_prefix_caching=True)
    s.add_request(_req("warm", 10, None, max_tokens=1))  # same first 8 tokens, computed here
    _run_step(s)
    s.add_request(_req("a", 13, _remote(13, [5, 6, 7, 8])))
    (job,) = s.take_kv_loads()
    (remote, local), = job.groups
    assert remote == [7] and len(local) == 1  # blocks 0-1 hit locally; block 2 (tokens 8..11) read


def test_short_or_forged_block_lists_fall_back_to_local_prefill():
    s = _sched("kv_consumer")
    s.add_request(_req("a", 10, _remote(10, [5])))  # 1 block cannot hold 9 tokens
    s.add_request(_req("b", 10, _remote(4, [5, 6, 7]), first=40))  # the source says it holds 4 tokens
    assert s.take_kv_loads() == [] and s.kv_transfer.stats.recomputed == 2
    out = s.schedule()
    assert {c.req_id: c.start_pos for c in out.chunks} == {"a": 0, "b": 0}


def test_abort_while_loading_frees_blocks_only_when_the_load_ends():
    s = _sched("kv_consumer")
    free0 = s.kv.num_free_blocks()
    s.add_request(_req("a", 10, _remote(10, [5, 6, 7])))
    s.take_kv_loads()
    s.finish_request("a", "abort")
    assert s.kv.num_free_blocks() == free0 - 3  # a transfer may still be writing them
    s.finish_kv_load("a", True)
    assert s.kv.num_free_blocks() == free0 and not s.has_unfinished()


def test_loading_request_is_never_the_preemption_victim():
    s = _sched("kv_consumer", num_blocks=8)  # 7 usable blocks
    s.add_request(_req("d", 4, None, max_tokens=20, first=60))
    _run_step(s)  # d decodes from here on: 1 block
    s.add_request(_req("a", 22, _remote(22, [1, 2, 3, 4, 5, 6])))  # 6 blocks, all the rest
    (job,) = s.take_kv_loads()
    assert s.kv.num_free_blocks() == 0
    for _ in range(6):  # d fills its block; its next token needs a block: d itself gives way, not "a"
        out = s.schedule()
        if out is None:
            break
        s.update(out, ModelRunnerOutput(sampled={c.req_id: [7] for c in out.chunks if c.sample}))
    assert s.requests["d"].status == RequestStatus.PREEMPTED and s.num_preemptions == 1
    assert s.requests["a"].status == RequestStatus.RUNNING and s.kv_transfer.is_loading("a")


# -- tensor parallel head split, block copies -----------------------------------------------------------------
def test_read_plan_between_tp_sizes():
    assert list(rank_heads(4, 2, 1)) == [2, 3]
    assert read_plan(4, 1, 2, 1) == [type(read_plan(4, 1, 2, 1)[0])(0, 2, 0, 2)]  # TP1 -> TP2: heads 2-3 of rank 0
    plan = read_plan(4, 2, 1, 0)  # TP2 -> TP1: two slices, one per source rank
    assert [(p.src_rank, p.src_start, p.dst_start, p.count) for p in plan] == [(0, 0, 0, 2), (1, 0, 2, 2)]
    assert [(p.src_rank, p.count) for p in read_plan(2, 2, 4, 3)] == [(1, 1)]  # replicated heads


def test_gather_scatter_round_trip_with_a_head_slice():
    torch.manual_seed(0)
    src = [(torch.randn(8 * BS, 4, 2), torch.randn(8 * BS, 4, 2)) for _ in range(2)]
    dst = [(torch.zeros(8 * BS, 2, 2), torch.zeros(8 * BS, 2, 2)) for _ in range(2)]
    frames = gather_blocks(src, [3, 5], BS, 2, 2)
    scatter_blocks(dst, [1, 6], BS, 0, frames)
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[BS:2 * BS], sk[3 * BS:4 * BS, 2:]) and torch.equal(dv[6 * BS:7 * BS], sv[5 * BS:6 * BS, 2:])
        assert not dk[:BS].any()
    with pytest.raises(ValueError, match="does not fit"):
        scatter_blocks(dst, [1], BS, 0, frames)


def _free_port() -> int:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def test_block_server_serves_only_held_blocks_with_the_secret():
    port = _free_port()
    kv = [(torch.arange(8 * BS * 2 * 2, dtype=torch.float32).view(8 * BS, 2, 2),) * 2]
    server = BlockServer("127.0.0.1", port, kv, BS, "p0")
    client = BlockClient()
    addr = f"127.0.0.1:{port}"
    try:
        server.hold("r1", "sec", [[2, 3]])
        frames = client.read(addr, "r1", "sec", "p0", [[3]], (1, 1), 5)
        assert len(frames) == 2 and torch.equal(frames[0], kv[0][0][3 * BS:4 * BS, 1:2].unsqueeze(0))
        for args, match in [(("r1", "bad", "p0", [[3]]), "wrong secret"), (("r1", "sec", "p0", [[4]]), "not the ones"),
                            (("r2", "sec", "p0", [[3]]), "no blocks are held"), (("r1", "sec", "p9", [[3]]), "not 'p9'")]:
            with pytest.raises(TransferError, match=match):
                client.read(addr, *args, (0, 1), 5)
        with pytest.raises(TransferError, match="heads"):
            client.read(addr, "r1", "sec", "p0", [[3]], (1, 5), 5)
        with pytest.raises(TransferError, match="not 'p9'"):
            client.release(addr, "r1", "sec", "p9", 5)
        client.release(addr, "r1", "sec", "p0", 5)
        assert server.drain_released() == ["r1"]
        with pytest.raises(TransferError, match="no blocks are held"):
            client.read(addr, "r1", "sec", "p0", [[3]], (0, 1), 5)
        server.hold("r2", "sec", [[3]])  # a NixlConnector reader of a TcpConnector source: refused, never served
        with pytest.raises(TransferError, match="unknown op 'nixl_meta'; valid ops: read, release"):
            client.call(addr, {"op": "nixl_meta", "key": "r2", "secret": "sec", "groups": [[3]]}, 5)
    finally:
        client.close()
        server.close()


@pytest.mark.skipif(not nixl_installed(), reason="the optional nixl package is not installed (pip install nixl)")
def test_nixl_reads_held_blocks_whole_or_a_head_slice_and_only_with_the_secret(monkeypatch):
    from vllm_neuron.distributed.kv_transfer.nixl import NixlAgent

    torch.manual_seed(0)
    src = [(torch.randn(8 * BS, 4, 2), torch.randn(8 * BS, 4, 2)) for _ in range(2)]
    whole = [(torch.zeros(8 * BS, 4, 2), torch.zeros(8 * BS, 4, 2)) for _ in range(2)]
    half = [(torch.zeros(8 * BS, 2, 2), torch.zeros(8 * BS, 2, 2)) for _ in range(2)]  # a TP=2 reader's heads
    port = _free_port()
    source, reader, half_reader = (NixlAgent(kv, BS, name, 0) for kv, name in [(src, "p0"), (whole, "d0"),
                                                                                (half, "d1")])
    server = BlockServer("127.0.0.1", port, src, BS, "p0", {"nixl_meta": source.meta_reply})
    client, addr = BlockClient(), f"127.0.0.1:{port}"
    hold = {"key": "r1", "secret": "sec", "engine_id": "p0"}
    try:
        server.hold("r1", "sec", [[2, 3, 5]])
        # A forged secret gets neither the agent's metadata nor a byte of KV.
        for forged, match in [({**hold, "secret": "bad"}, "wrong secret"), ({**hold, "engine_id": "p9"}, "not 'p9'")]:
            with pytest.raises(TransferError, match=match):
                reader.read(client, addr, forged, [([3], [1])], HeadSlice(0, 0, 0, 4), 5)
        with pytest.raises(TransferError, match="not the ones held"):
            reader.read(client, addr, hold, [([4], [1])], HeadSlice(0, 0, 0, 4), 5)
        assert reader.remote_agents == {} and not any(t.any() for p in whole for t in p)
        per_head = 2 * 2 * BS * 2 * 4  # per block: 2 layers' K and V, BS slots of head_dim 2 in fp32
        assert reader.read(client, addr, hold, [([3, 2], [1, 6])], HeadSlice(0, 0, 0, 4), 5) == 2 * 4 * per_head
        assert half_reader.read(client, addr, hold, [([5], [7])], HeadSlice(0, 2, 0, 2), 5) == 2 * per_head
        for (sk, sv), (wk, wv), (hk, hv) in zip(src, whole, half):
            assert torch.equal(wk[BS:2 * BS], sk[3 * BS:4 * BS]) and torch.equal(wv[6 * BS:7 * BS], sv[2 * BS:3 * BS])
            assert not wk[:BS].any() and not wk[2 * BS:6 * BS].any()
            assert torch.equal(hk[7 * BS:], sk[5 * BS:6 * BS, 2:]) and torch.equal(hv[7 * BS:], sv[5 * BS:6 * BS, 2:])
            assert not hk[:7 * BS].any()
        assert reader.remote_agents == {addr: source.name}
        # The hold went while the blocks were read (freed, maybe reused): the read is refused after the fact.
        transfer = reader._transfer
        monkeypatch.setattr(reader, "_transfer", lambda *a: (transfer(*a), server.forget("r1")))
        with pytest.raises(TransferError, match="no blocks are held"):
            reader.read(client, addr, hold, [([3], [1])], HeadSlice(0, 0, 0, 4), 5)
        monkeypatch.undo()
        # The source restarts on the same port under a new agent: the reader adds that one instead.
        server.close()
        source.close()
        source = NixlAgent(src, BS, "p0", 0)
        server = BlockServer("127.0.0.1", port, src, BS, "p0", {"nixl_meta": source.meta_reply})
        server.hold("r1", "sec", [[4]])
        whole[0][0].zero_()
        reader.read(client, addr, hold, [([4], [0])], HeadSlice(0, 0, 0, 4), 5)
        assert reader.remote_agents == {addr: source.name} and torch.equal(whole[0][0][:BS], src[0][0][4 * BS:5 * BS])
    finally:
        client.close()
        server.close()
        for agent in (source, reader, half_reader):
            agent.close()


def test_unreachable_or_silent_source_fails_fast():
    import socket

    client = BlockClient()
    silent = socket.socket()  # listens, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        with pytest.raises(TransferError, match="cannot reach 127.0.0.1:9"):
            client.read("127.0.0.1:9", "r", "s", "", [[1]], (0, 1), 5)
        with pytest.raises(TransferError, match="no answer .* within 0.2 s"):
            client.read(f"127.0.0.1:{silent.getsockname()[1]}", "r", "s", "", [[1]], (0, 1), 0.2)
    finally:
        client.close()
        silent.close()


# -- the proxy's pure parts ---------------------------------------------------------------------------------
def test_prefill_body_follows_vllms_protocol():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 50}
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out and body["max_tokens"] == 50
    assert out["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                         "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                         "remote_port": None}


def test_pool_least_outstanding_and_failure_backoff():
    clock = Clock()
    pool = InstancePool("prefill", ["http://a", "http://b/"], backoff_s=5, clock=clock)
    a, b = pool.instances
    assert b.url == "http://b" and pool.order()[0] is a
    pool.start(a)
    assert pool.order()[0] is b
    pool.finish(a, ok=False)  # a failed: skipped while down, even with fewer outstanding
    pool.start(b)
    assert pool.order() == [b, a] and pool.healthy() == [b]
    clock.t = 6
    pool.finish(b, ok=True)
    assert pool.order()[0] is b and pool.healthy() == [a, b]  # a is back, but it failed before: ties go to b
    with pytest.raises(ValueError, match="not an http"):
        InstancePool("decode", ["localhost:8000"])
    with pytest.raises(ValueError, match="at least one --decode"):
        InstancePool("decode", [])
