"""Encoder outputs kept on the device, keyed by media hash: a request's later prefill segments and
other requests with the same image reuse them instead of running the vision tower again.

Bounded in bytes (least recently used first out); the runner reserves its bound in the memory budget.
Counts hits and misses (per media item) for /metrics.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embeds [n, hidden], deepstack [D, n, hidden]) of a media item, counting a hit or a miss."""
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, embeds: torch.Tensor, deepstack: torch.Tensor) -> None:
        size = embeds.nbytes + deepstack.nbytes
        if key in self._entries or size > self.max_bytes:
            return  # an item larger than the whole cache is used once and dropped
        while self.nbytes + size > self.max_bytes:
            _, (e, d) = self._entries.popitem(last=False)
            self.nbytes -= e.nbytes + d.nbytes
        self._entries[key] = (embeds, deepstack)
        self.nbytes += size
