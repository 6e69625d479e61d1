"""Stored responses for `previous_response_id` and `GET /v1/responses/{id}`: in memory, bounded (the
oldest goes first), off unless the server opts in (--enable-store or VLLM_ENABLE_RESPONSES_API_STORE=1,
as vLLM). Each entry keeps the response object and the conversation that produced it (chat messages,
the response's own output as the last assistant turn), which a follow-up request continues."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, max_entries: int) -> None:
        if max_entries < 0:
            raise ValueError(f"the responses store size must be >= 0 (0: off), got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._entries.get(response_id)

    def __len__(self) -> int:
        return len(self._entries)
