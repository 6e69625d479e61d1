"""Adapters loaded into host memory, at most `capacity` (--max-cpu-loras), least recently used dropped first
(pure: the loader is given). A slot keeps its own copy on the device, so dropping an adapter here only means
reading its folder again the next time it takes a slot."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class HostLRU(Generic[K, V]):
    def __init__(self, capacity: int, load: Callable[[K], V]) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._load = load
        self._items: OrderedDict[K, V] = OrderedDict()
        self.loads = 0  # folder reads, for tests and logs

    def get(self, key: K) -> V:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = self._load(key)  # raises before anything is evicted
        self.loads += 1
        self._items[key] = value
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value

    def drop(self, key: K) -> None:
        self._items.pop(key, None)

    def keys(self) -> list[K]:
        """Least recently used first."""
        return list(self._items)
