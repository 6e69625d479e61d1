"""The custom logits processors' view of the host sampler's requests (vllm_neuron/logits_processor.py): a
persistent batch where each live request keeps its index, and the BatchUpdate of what changed since the
last step. A removed request's index is filled by the last one (a move), as vLLM's persistent batch does,
so indices stay 0..batch_size-1.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_neuron.logits_processor import BatchUpdate, MoveDirectionality, load_logits_processor
from vllm_neuron.sampling_params import SamplingParams


class LogitsProcessorBatch:
    def __init__(self, specs: Sequence, config, device: torch.device) -> None:
        self.processors = [load_logits_processor(s)(config, device, False) for s in specs]
        self.order: list[str] = []  # request id at each index
        self.index: dict[str, int] = {}
        self._added: dict[int, tuple] = {}  # index -> AddedRequest, not told yet
        self._removed: list[int] = []
        self._moved: list[tuple[int, int, MoveDirectionality]] = []

    def add(self, req_id: str, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        i = len(self.order)
        self.order.append(req_id)
        self.index[req_id] = i
        self._added[i] = (i, params, prompt_ids, output_ids)

    def remove(self, req_id: str) -> None:
        i = self.index.pop(req_id, None)
        if i is None:
            return
        if self._added.pop(i, None) is None:
            self._removed.append(i)
        last = len(self.order) - 1
        if i != last:
            moved = self.order[last]
            self.order[i] = moved
            self.index[moved] = i
            pending = self._added.pop(last, None)
            if pending is not None:  # not told yet: it is added at its new index
                self._added[i] = (i, *pending[1:])
            else:
                self._moved.append((last, i, MoveDirectionality.UNIDIRECTIONAL))
        self.order.pop()

    def _update(self) -> BatchUpdate | None:
        if not (self._added or self._removed or self._moved):
            return None
        update = BatchUpdate(len(self.order), self._removed, list(self._added.values()), self._moved)
        self._added, self._removed, self._moved = {}, [], []
        return update

    def apply(self, logits: torch.Tensor, req_ids: list[str]) -> torch.Tensor:
        """logits [N, V] of the requests `req_ids` (every one in the batch) -> processed, same rows."""
        update = self._update()
        rows = torch.tensor([self.index[r] for r in req_ids], dtype=torch.long)
        full = logits.new_zeros((len(self.order), logits.shape[1]))
        full[rows] = logits
        for p in self.processors:
            p.update_state(update)
            full = p.apply(full)
        return full[rows]
