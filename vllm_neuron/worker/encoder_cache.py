"""Encoder outputs kept on the device in fixed-size blocks, keyed by media hash: a request's later prefill
segments and other requests with the same image or clip reuse them instead of running the encoder again.

Seed 001's layout: one buffer `[num_blocks, block_tokens, width]` allocated once (its bytes are reserved in
the memory budget), where a row holds a token's embedding followed by its deepstack rows (vision) and
`block_tokens` is what one encoder attention block yields. An item takes whole blocks (a small image still
takes one), so the count is sized in blocks: `encoder_cache_num_blocks` is a floor over what the
scheduler's budget needs (`encoder_cache_blocks`).

Eviction frees the least recently used item whose blocks are older than the hold time
(`encoder_cache_min_hold_time_ms`): a block written less than that ago is never freed, because a remote
reader (EPD) may still be pulling it. When nothing can be freed, the new item is used by its step and not
kept. Reads copy the rows out (a gather), so a later write never changes embeddings already handed out.
Hits, misses and evictions (per media item) go to /metrics.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class EncoderCacheLayout:
    """What one cached token holds: `hidden` embedding values and `deepstack` more rows of `hidden`."""

    block_tokens: int
    hidden: int
    deepstack: int
    dtype: torch.dtype

    @property
    def width(self) -> int:
        return self.hidden * (1 + self.deepstack)

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.width * self.dtype.itemsize

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)


def encoder_cache_blocks(requested: int | None, budget_tokens: int, default_bytes: int,
                         layout: EncoderCacheLayout) -> tuple[int, str]:
    """(blocks, why): the blocks the scheduler's encoder budget (`budget_tokens`: the most media tokens one
    step can need) takes, raised to `requested` (encoder_cache_num_blocks, a floor, not an override: a
    smaller value is raised to the minimum); with nothing requested, also up to `default_bytes`."""
    minimum = max(1, layout.blocks_for(budget_tokens))
    if requested is None:
        blocks = max(minimum, default_bytes // layout.block_bytes)
        return blocks, f"auto: {blocks} blocks ({minimum} needed by the encoder budget of {budget_tokens} tokens)"
    if requested < minimum:
        return minimum, (f"encoder_cache_num_blocks={requested} raised to {minimum}, the minimum the encoder "
                         f"budget of {budget_tokens} tokens needs")
    return requested, f"encoder_cache_num_blocks={requested}"


@dataclass
class _Entry:
    blocks: list[int]
    tokens: int
    written: float


class EncoderCache:
    def __init__(self, layout: EncoderCacheLayout, num_blocks: int, *, hold_time_ms: float = 0.0,
                 device: torch.device | str = "cpu", clock: Callable[[], float] = time.monotonic) -> None:
        self.layout, self.num_blocks = layout, num_blocks
        self.hold_s = hold_time_ms / 1000.0
        self.clock = clock
        # torch.empty: on CPU the pages are only touched as blocks are written.
        self.buffer = torch.empty(num_blocks, layout.block_tokens, layout.width, dtype=layout.dtype, device=device)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))
        self.hits = self.misses = self.evictions = 0

    @property
    def max_bytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embeds [n, hidden], deepstack [D, n, hidden]) of a media item, counting a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        rows = self.buffer[entry.blocks].reshape(-1, self.layout.width)[:entry.tokens]
        h, d = self.layout.hidden, self.layout.deepstack
        return rows[:, :h], rows[:, h:].reshape(entry.tokens, d, h).permute(1, 0, 2)

    def put(self, key: str, embeds: torch.Tensor, deepstack: torch.Tensor | None = None) -> bool:
        """Keeps an item's rows (deepstack [D, n, hidden], or None / empty without deepstack); False when it
        is not kept (larger than the cache, or every block is within its hold time)."""
        if key in self._entries:
            return True
        n = embeds.shape[0]
        need = self.layout.blocks_for(n)
        if need > self.num_blocks or not self._make_room(need):
            return False
        blocks = [self._free.pop() for _ in range(need)]
        rows = embeds.to(self.layout.dtype)
        if self.layout.deepstack:
            rows = torch.cat([rows, deepstack.to(self.layout.dtype).permute(1, 0, 2).reshape(n, -1)], dim=1)
        padded = rows.new_zeros(need * self.layout.block_tokens, self.layout.width)
        padded[:n] = rows
        self.buffer[blocks] = padded.view(need, self.layout.block_tokens, -1).to(self.buffer.device)
        self._entries[key] = _Entry(blocks, n, self.clock())
        return True

    def _make_room(self, need: int) -> bool:
        """Frees least recently used items past their hold time until `need` blocks are free."""
        if len(self._free) >= need:
            return True
        now = self.clock()
        for key in list(self._entries):
            entry = self._entries[key]
            if now - entry.written < self.hold_s:
                continue  # a reader may still be pulling it
            del self._entries[key]
            self._free.extend(entry.blocks)
            self.evictions += 1
            if len(self._free) >= need:
                return True
        return False
