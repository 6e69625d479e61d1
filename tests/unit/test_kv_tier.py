"""KV offloading's pieces without an engine: the options, the block file format and its checks, one rank's store
(write, read back, evict, a restart's scan, bad files), the scheduler's side (admission to read, partial reads,
aborts while reading) and the refused combinations."""
from __future__ import annotations

import os

import pytest
import torch

from vllm_neuron import metrics
from vllm_neuron.config.compatibility import Features, check
from vllm_neuron.config.kv_offload import block_file, parse_kv_offloading
from vllm_neuron.core.block_hash import prompt_block_hashes
from vllm_neuron.core.kv_tier import KVTierScheduler
from vllm_neuron.core.request import Request, RequestStatus
from vllm_neuron.core.scheduler import Scheduler, SchedulerConfig
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.step import ModelRunnerOutput, TierLoadJob
from vllm_neuron.worker.kv_tier_store import PENDING, BadBlockFile, KVTierStore, decode_block, encode_block

BS = 4


def test_options_and_their_errors(tmp_path):
    assert parse_kv_offloading(None, None, str(tmp_path)) is None
    cfg = parse_kv_offloading(0.5, None, str(tmp_path / "tier"))
    assert cfg.size_bytes == 2**29 and cfg.backend == "native" and os.path.isdir(tmp_path / "tier")
    assert parse_kv_offloading("2", "native", str(tmp_path)).size_bytes == 2 * 2**30
    with pytest.raises(ValueError, match="kv_offloading_backend='lmcache' is not supported yet.*native"):
        parse_kv_offloading(1, "lmcache", str(tmp_path))
    with pytest.raises(ValueError, match=r"kv_offloading_backend=.disk. is not valid; valid values: \[.native.\]"):
        parse_kv_offloading(1, "disk", str(tmp_path))
    with pytest.raises(ValueError, match="kv_offloading_size must be > 0"):
        parse_kv_offloading(0, None, str(tmp_path))
    with pytest.raises(ValueError, match="needs kv_offloading_size"):
        parse_kv_offloading(None, "native", str(tmp_path))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="a_file/tier .*VLLM_NEURON_KV_OFFLOAD_DIR.* not a writable folder"):
        parse_kv_offloading(1, None, str(tmp_path / "a_file" / "tier"))


@pytest.mark.parametrize("features, match", [
    (dict(kv_offload=True, prefix_caching=False), "needs prefix caching"),
    (dict(kv_offload=True, sliding_window=True), "sliding-window"),
    (dict(kv_offload=True, kv_transfer=True), "one KV connector"),
    (dict(kv_offload=True, speculative="ngram"), "speculative_config='ngram'"),
    (dict(kv_offload=True, multimodal=True), "multimodal"),
])
def test_refused_combinations(features, match):
    with pytest.raises(ValueError, match=f"kv_offloading_size .*{match}"):
        check(Features(**features))
    check(Features(kv_offload=True, tensor_parallel_size=2, lora=True))
    check(Features(kv_offload=True, prompt_embeds=True))


def _tensors(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BS, 2, 8, generator=g).to(dtype) for _ in range(4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_file_round_trip_and_every_check(dtype):
    h = bytes(range(32))
    t = _tensors(dtype)
    expect = [([BS, 2, 8], dtype)] * 4
    data = encode_block("model-a", h, t)
    back = decode_block(data, "model-a", h, expect)
    assert all(torch.equal(a, b) for a, b in zip(t, back))
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    bad = {"torn": data[:-100], "flipped": bytes(flipped), "empty": b"", "not ours": b"x" * 200}
    for name, blob in bad.items():
        with pytest.raises(BadBlockFile):
            decode_block(blob, "model-a", h, expect)
    with pytest.raises(BadBlockFile, match="another model or block"):
        decode_block(data, "model-b", h, expect)  # a foreign file: another model's, under the same name
    with pytest.raises(BadBlockFile, match="another model or block"):
        decode_block(data, "model-a", bytes(32), expect)
    with pytest.raises(BadBlockFile, match="tensors"):
        decode_block(data, "model-a", h, [([BS, 2, 4], dtype)] * 4)


def _pool(num_blocks=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(num_blocks * BS, 2, 8, generator=g), torch.randn(num_blocks * BS, 2, 8, generator=g))
            for _ in range(2)]


def _block(kv, b):
    return [t[b * BS:(b + 1) * BS] for pair in kv for t in pair]


def _wait(store, rid):
    import time

    deadline = time.monotonic() + 10
    while (n := store.poll([rid])[0]) == PENDING:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return n


def test_store_writes_reads_back_evicts_and_survives_a_restart(tmp_path):
    cfg = parse_kv_offloading(1, None, str(tmp_path))
    src = _pool()
    store = KVTierStore(cfg, "key", src, BS, rank=0, world=1)
    hashes = [bytes([i]) * 32 for i in range(4)]
    store.store([(1, hashes[0]), (2, hashes[1]), (5, hashes[2])])
    store.flush()
    files = [block_file(store.folder, h, 0) for h in hashes]
    assert [os.path.exists(f) for f in files] == [True, True, True, False]
    # A fresh pool (a restart) reads them back into other blocks, byte for byte.
    dst = _pool(seed=1)
    again = KVTierStore(cfg, "key", dst, BS, rank=0, world=1)
    assert again._bytes == sum(os.path.getsize(f) for f in files[:3])
    again.load([TierLoadJob("r", hashes[:3], [6, 3, 4])])
    assert _wait(again, "r") == 3
    n, nbytes, _ = again.finish(["r"])[0]
    assert n == 3 and nbytes == again._bytes
    for s_b, d_b in ((1, 6), (2, 3), (5, 4)):
        assert all(torch.equal(a, b) for a, b in zip(_block(src, s_b), _block(dst, d_b)))
    # Another model's store (other key) has its own folder: it finds nothing there.
    other = KVTierStore(cfg, "other", _pool(), BS, 0, 1)
    assert other.folder != store.folder and other._bytes == 0
    other.close()
    # A read stops at a missing file; the blocks before it are read.
    again.load([TierLoadJob("m", [hashes[0], hashes[3], hashes[1]], [1, 2, 3])])
    assert _wait(again, "m") == 1
    # A torn file ends the read there and is deleted.
    with open(files[1], "r+b") as f:
        f.truncate(os.path.getsize(files[1]) - 7)
    again.load([TierLoadJob("t", hashes[:3], [1, 2, 3])])
    assert _wait(again, "t") == 1 and not os.path.exists(files[1])
    for s in (store, again):
        s.close()


def test_store_keeps_its_share_of_the_size_least_recently_used_first(tmp_path):
    kv = _pool()
    one = len(encode_block("key", bytes(32), _block(kv, 0)))
    cfg = parse_kv_offloading(3.5 * one / 2**30 * 2, None, str(tmp_path))  # two ranks: 3.5 blocks each
    store = KVTierStore(cfg, "key", kv, BS, rank=0, world=2)
    hashes = [bytes([i]) * 32 for i in range(5)]
    store.store([(b, hashes[b]) for b in range(3)])
    store.flush()
    store.load([TierLoadJob("r", [hashes[0]], [7])])  # block 0 is now the most recently used
    assert _wait(store, "r") == 1
    store.store([(3, hashes[3]), (4, hashes[4])])
    store.flush()
    kept = [os.path.exists(block_file(store.folder, h, 0)) for h in hashes]
    assert kept == [True, False, False, True, True] and store._bytes == 3 * one
    store.close()


def test_a_write_that_fails_is_counted_and_the_store_goes_on(tmp_path):
    cfg = parse_kv_offloading(1, None, str(tmp_path))
    store = KVTierStore(cfg, "key", _pool(), BS, 0, 1)
    os.makedirs(store.folder, exist_ok=True)
    blocked = bytes([0xAB]) * 32
    with open(os.path.join(store.folder, "ab"), "w") as f:  # a file where the block's sub-folder must go
        f.write("x")
    store.store([(1, blocked), (2, bytes(32))])
    store.flush()
    assert store.store_errors == 1 and os.path.exists(block_file(store.folder, bytes(32), 0))
    store.close()


def _req(rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=None)


def _tier_sched(tmp_path, tp_size: int = 1, num_blocks: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=BS,
                                     num_blocks=num_blocks), kv_tier=KVTierScheduler(str(tmp_path), tp_size))


def _put(folder, hashes, ranks=(0,)):
    for h in hashes:
        for r in ranks:
            path = block_file(str(folder), h, r)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").close()


def test_scheduler_admits_a_request_to_read_the_tier_then_prefills_the_rest(tmp_path):
    tokens = list(range(100, 118))  # 18 tokens: 4 full blocks before the last token
    hashes = prompt_block_hashes(tokens[:-1], BS)
    _put(tmp_path, hashes[:3])  # the tier has the first 3 blocks
    s = _tier_sched(tmp_path)
    s.add_request(_req("a", tokens))
    assert s.schedule() is None  # admitted to read, nothing to prefill yet
    loads, stores = s.take_tier_work()
    req = s.requests["a"]
    assert [j.hashes for j in loads] == [hashes[:3]] and loads[0].blocks == s.kv.block_table("a")[:3]
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 0 and not stores
    assert s.schedule() is None  # still reading
    s.finish_tier_load("a", 3)
    out = s.schedule()
    assert [(c.start_pos, len(c.token_ids)) for c in out.chunks] == [(12, 6)] and req.num_cached_tokens == 12
    s.update(out, ModelRunnerOutput(sampled={"a": [5]}))
    # The block prefilled here (the 4th) goes to the tier; the three read back are there already.
    assert [h for _, h in s.take_tier_work()[1]] == [hashes[3]]
    assert s.kv_tier.stats.loaded_blocks == 3 and s.kv_tier.stats.failed_loads == 0


def test_a_partial_read_prefills_from_the_first_block_not_read(tmp_path):
    tokens = list(range(200, 218))
    hashes = prompt_block_hashes(tokens[:-1], BS)
    _put(tmp_path, hashes)
    s = _tier_sched(tmp_path)
    s.add_request(_req("a", tokens))
    s.schedule()
    s.finish_tier_load("a", 1)  # the second file was bad
    out = s.schedule()
    assert out.chunks[0].start_pos == 4 and s.requests["a"].num_cached_tokens == 4
    assert s.kv_tier.stats.failed_loads == 1


def test_tensor_parallel_needs_every_ranks_file_and_a_miss_ends_the_run(tmp_path):
    tier = KVTierScheduler(str(tmp_path), tp_size=2)
    hs = [bytes([i]) * 32 for i in range(4)]
    _put(tmp_path, hs[:2], ranks=(0, 1))
    _put(tmp_path, hs[2:], ranks=(0,))  # rank 1's files missing
    assert tier.extension(hs, 0) == hs[:2] and tier.extension(hs, 1) == hs[1:2] and tier.extension(hs, 2) == []
    _put(tmp_path, [hs[3]], ranks=(1,))
    assert tier.extension(hs, 0) == hs[:2]  # the run ends at the first miss


def test_a_request_aborted_while_reading_frees_its_blocks_when_the_read_ends(tmp_path):
    tokens = list(range(300, 318))
    _put(tmp_path, prompt_block_hashes(tokens[:-1], BS))
    s = _tier_sched(tmp_path)
    free0 = s.kv.num_free_blocks()
    s.add_request(_req("a", tokens))
    s.schedule()
    s.finish_request("a", "abort")
    assert s.kv.num_free_blocks() < free0  # the reader may still write them
    s.finish_tier_load("a", 4)
    assert s.kv.num_free_blocks() == free0 and not s.has_unfinished()


def test_metrics_series():
    metrics.configure("tier-test")
    metrics.record_kv_offload(loaded=3, stored=5, failed=1, nbytes=4096, seconds=[0.002])
    series = (metrics.KV_OFFLOAD_LOADED, metrics.KV_OFFLOAD_STORED, metrics.KV_OFFLOAD_FAILED,
              metrics.KV_OFFLOAD_READ_BYTES, metrics.KV_OFFLOAD_TIME)
    values = {s.name: s.value for m in series for s in m.collect()[0].samples
              if s.labels.get("model_name") == "tier-test"}
    assert values["vllm_neuron:kv_offload_loaded_blocks_total"] == 3
    assert values["vllm_neuron:kv_offload_stored_blocks_total"] == 5
    assert values["vllm_neuron:kv_offload_failed_loads_total"] == 1
    assert values["vllm_neuron:kv_offload_read_bytes_total"] == 4096
    assert values["vllm_neuron:kv_offload_load_time_seconds_count"] == 1
