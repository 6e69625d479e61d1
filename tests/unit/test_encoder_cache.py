"""The block encoder cache: layout round trip, LRU eviction, the hold time, sizing as a floor."""
from __future__ import annotations

import pytest
import torch

from vllm_neuron.worker.encoder_cache import EncoderCache, EncoderCacheLayout, encoder_cache_blocks

LAYOUT = EncoderCacheLayout(block_tokens=4, hidden=3, deepstack=2, dtype=torch.float32)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _item(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(2, n, 3, generator=g)


def test_rows_come_back_exactly_across_blocks():
    cache = EncoderCache(LAYOUT, 4)
    emb, ds = _item(6, 0)  # two blocks, the second half full
    assert cache.put("a", emb, ds)
    assert cache.free_blocks == 2
    got_emb, got_ds = cache.get("a")
    assert torch.equal(got_emb, emb) and torch.equal(got_ds, ds)
    # A read is a copy: overwriting the blocks later does not change what was handed out.
    cache.buffer.fill_(7.0)
    assert torch.equal(got_emb, emb)
    assert (cache.hits, cache.misses) == (1, 0)
    assert cache.get("b") is None and cache.misses == 1


def test_without_deepstack():
    cache = EncoderCache(EncoderCacheLayout(4, 3, 0, torch.float32), 2)
    emb = torch.randn(5, 3)
    assert cache.put("clip", emb)
    got, ds = cache.get("clip")
    assert torch.equal(got, emb) and ds.shape == (0, 5, 3)


def test_least_recently_used_item_is_evicted():
    cache = EncoderCache(LAYOUT, 3)
    for i, key in enumerate("abc"):
        cache.put(key, *_item(4, i))
    cache.get("a")  # b is now the least recently used
    assert cache.put("d", *_item(4, 3))
    assert "b" not in cache and {"a", "c", "d"} <= set(cache._entries)
    assert cache.evictions == 1
    assert torch.equal(cache.get("d")[0], _item(4, 3)[0])


def test_a_block_younger_than_the_hold_time_is_never_freed():
    clock = Clock()
    cache = EncoderCache(LAYOUT, 2, hold_time_ms=100.0, clock=clock)
    cache.put("a", *_item(4, 0))
    clock.t += 0.05
    cache.put("b", *_item(4, 1))
    clock.t += 0.06  # a is 110 ms old, b 60 ms
    assert cache.put("c", *_item(4, 2))  # frees a, the only block past its hold time
    assert "a" not in cache and "b" in cache
    assert not cache.put("d", *_item(4, 3))  # b and c are both held: d is used once, not kept
    assert {"b", "c"} == set(cache._entries) and cache.evictions == 1
    assert torch.equal(cache.get("b")[0], _item(4, 1)[0])
    clock.t += 0.1
    assert cache.put("d", *_item(4, 3)) and cache.evictions == 2


def test_an_item_larger_than_the_cache_is_not_kept():
    cache = EncoderCache(LAYOUT, 2)
    assert not cache.put("big", *_item(9, 0))
    assert len(cache) == 0 and cache.free_blocks == 2


def test_sizing_is_a_floor_over_the_budget():
    bb = LAYOUT.block_bytes  # 4 tokens x 9 values x 4 bytes
    assert encoder_cache_blocks(None, 10, 0, LAYOUT)[0] == 3  # ceil(10 / 4)
    assert encoder_cache_blocks(None, 10, 50 * bb, LAYOUT)[0] == 50
    blocks, why = encoder_cache_blocks(2, 10, 50 * bb, LAYOUT)
    assert blocks == 3 and "raised to 3" in why
    assert encoder_cache_blocks(8, 10, 50 * bb, LAYOUT)[0] == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dtype_follows_the_layout(dtype):
    cache = EncoderCache(EncoderCacheLayout(4, 3, 2, dtype), 2)
    emb, ds = _item(3, 0)
    cache.put("a", emb, ds)
    got_emb, got_ds = cache.get("a")
    assert got_emb.dtype == dtype and torch.equal(got_ds, ds.to(dtype))
