"""The custom logits processors' view of the host sampler's requests (vllm_neuron/logits_processor.py): a
persistent batch where each live request keeps its index, and the BatchUpdate of what changed since the
last step, as vLLM's persistent batch makes it: a new request takes the lowest free index, and at the step
the holes left are filled by moving the last requests down, so that indices stay 0..batch_size-1 and the
update reads in its order (removed, then added, then moved) without one change overwriting another.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_neuron.logits_processor import BatchUpdate, MoveDirectionality, load_logits_processor
from vllm_neuron.sampling_params import SamplingParams


class LogitsProcessorBatch:
    def __init__(self, specs: Sequence, config, device: torch.device) -> None:
        self.processors = [load_logits_processor(s)(config, device, False) for s in specs]
        self.order: list[str | None] = []  # request id at each index; None: a hole until the next step
        self.index: dict[str, int] = {}
        self._added: dict[int, tuple] = {}  # index -> AddedRequest, not told yet
        self._removed: list[int] = []
        self._moved: list[tuple[int, int, MoveDirectionality]] = []

    def add(self, req_id: str, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        holes = [i for i, r in enumerate(self.order) if r is None]
        if holes:
            i = holes[0]
            self.order[i] = req_id
        else:
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
        self.order[i] = None

    def _condense(self) -> None:
        """Moves the last requests into the holes (vLLM's condense), recording the moves."""
        while True:
            while self.order and self.order[-1] is None:
                self.order.pop()
            if None not in self.order:
                return
            hole, last = self.order.index(None), len(self.order) - 1
            req = self.order.pop()
            self.order[hole], self.index[req] = req, hole
            pending = self._added.pop(last, None)
            if pending is not None:  # not told yet: it is added at its new index
                self._added[hole] = (hole, *pending[1:])
            else:
                self._moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))

    def _update(self) -> BatchUpdate | None:
        self._condense()
        if not (self._added or self._removed or self._moved):
            return None
        update = BatchUpdate(len(self.order), self._removed, list(self._added.values()), self._moved)
        self._added, self._removed, self._moved = {}, [], []
        return update

    def apply(self, logits: torch.Tensor, req_ids: list[str], argmax_invariant: bool = False) -> torch.Tensor:
        """logits [N, V] of the requests `req_ids` (every one in the batch) -> processed, same rows: the
        processors that can change the argmax (argmax_invariant False; the step's BatchUpdate goes to every
        processor then, so call it once per step first), or the argmax-invariant ones (after temperature)."""
        if not argmax_invariant:
            update = self._update()
            for p in self.processors:
                p.update_state(update)
        group = [p for p in self.processors if bool(p.is_argmax_invariant()) == argmax_invariant]
        if not group:
            return logits
        rows = torch.tensor([self.index[r] for r in req_ids], dtype=torch.long)
        full = logits.new_zeros((len(self.order), logits.shape[1]))
        full[rows] = logits
        for p in group:
            full = p.apply(full)
        return full[rows]
