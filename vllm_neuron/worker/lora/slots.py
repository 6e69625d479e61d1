"""Which adapter sits in which device slot (pure).

Slots 1..max_loras hold adapters (slot 0 is the base model's zero slot). A request holds its adapter's slot
from its first step to its end, so a slot is never refilled under a running request; an adapter no request
holds keeps its slot (and weights) until another adapter needs the room, least recently used first. The
scheduler never lets more distinct adapters run at once than there are slots (core/scheduler.py), so
`acquire` always finds one.
"""
from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot: dict[int, int] = {}  # adapter id -> slot
        self._holders: dict[int, int] = {}  # adapter id -> requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident adapters no request holds, LRU first
        self._free = list(range(max_loras, 0, -1))  # empty slots (popped from the end: 1 first)

    def acquire(self, adapter_id: int) -> tuple[int, bool]:
        """(slot, whether the adapter must be written into it) for one more request of `adapter_id`."""
        if adapter_id in self._slot:
            self._holders[adapter_id] += 1
            self._idle.pop(adapter_id, None)
            return self._slot[adapter_id], False
        if self._free:
            slot = self._free.pop()
        elif self._idle:
            evicted, _ = self._idle.popitem(last=False)
            slot = self._slot.pop(evicted)
            del self._holders[evicted]
        else:
            raise RuntimeError(f"all {self.max_loras} LoRA slots are held by running requests (adapters "
                               f"{sorted(self._slot)}); the scheduler admits at most max_loras distinct adapters")
        self._slot[adapter_id] = slot
        self._holders[adapter_id] = 1
        return slot, True

    def release(self, adapter_id: int) -> None:
        """One request of `adapter_id` ended; at zero the adapter stays resident but may be evicted."""
        n = self._holders.get(adapter_id, 0)
        if n <= 0:
            raise KeyError(f"adapter {adapter_id} holds no slot")
        self._holders[adapter_id] = n - 1
        if n == 1:
            self._idle[adapter_id] = None

    def forget(self, adapter_id: int) -> int | None:
        """Drops an idle adapter from its slot (its folder changed); returns the freed slot."""
        if self._holders.get(adapter_id, 0) > 0 or adapter_id not in self._slot:
            return None
        self._idle.pop(adapter_id, None)
        del self._holders[adapter_id]
        slot = self._slot.pop(adapter_id)
        self._free.append(slot)
        return slot

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot.get(adapter_id)

    def resident(self) -> dict[int, int]:
        """adapter id -> slot, for every resident adapter."""
        return dict(self._slot)
