"""`LoRAState`: LoRA as a component the runners call at fixed points (worker/model_kinds/base.py's hooks).

At set-up it gives the model's projections their slot tables (model/layers/lora.py). A request that joins
with a `LoRARequest` takes its adapter from the host LRU (reading the folder on a miss) and holds a device
slot until it finishes (worker/lora/slots.py); a slot an adapter newly takes is written in place, so no
graph is traced again. Each step's model input `lora_index` is every token's slot (prefill: by chunk;
decode: by row on MRv1, by batch slot on MRv2), 0 for the base model's tokens and for padding.

With tensor parallelism every rank runs this on its own runner and keeps its piece of each adapter, cut like
the base layer: column-parallel projections (q/k/v, gate/up) their B rows, row-parallel ones (o, down) their
A columns, so the all-reduce after the row-parallel layer sums the adapter's delta with the base's.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_neuron.config.lora import LoRAConfig
from vllm_neuron.logger import init_logger
from vllm_neuron.lora.peft_adapter import BaseShapes, LoRAWeights, load_adapter
from vllm_neuron.lora.request import LoRARequest
from vllm_neuron.model.layers.lora import FUSED_TARGETS, LoRASlots, attach_lora
from vllm_neuron.model.layers.parallel import shard_tensor
from vllm_neuron.step import NewRequestData, ScheduledChunk
from vllm_neuron.worker.input_builder import PrefillArrays
from vllm_neuron.worker.lora.host_cache import HostLRU
from vllm_neuron.worker.lora.slots import SlotTable
from vllm_neuron.worker.model_kinds.base import ModelKindState

logger = init_logger(__name__)

INDEX = "lora_index"  # the model's keyword input


class LoRAState(ModelKindState):
    def __init__(self, lora: LoRAConfig, hf_config, model: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = lora
        self.device = device
        self.base = BaseShapes.from_hf_config(hf_config)
        self.layers: dict[tuple[int, str], LoRASlots] = attach_lora(model, lora.max_loras + 1, lora.max_lora_rank,
                                                                     dtype, device)
        self.slots = SlotTable(lora.max_loras)
        self.host: HostLRU[tuple[int, str], LoRAWeights] = HostLRU(
            lora.max_cpu_loras, lambda key: load_adapter(key[1], self.base, lora.max_lora_rank))
        self._requests: dict[str, tuple[int, int]] = {}  # request id -> (adapter id, slot)
        self._paths: dict[int, str] = {}  # resident adapter id -> its folder
        self.slot_writes = 0  # adapters written into a slot (tests, logs)
        logger.info("LoRA: %d slots of rank %d on the device (%.1f MiB), up to %d adapters in host memory",
                    lora.max_loras, lora.max_lora_rank, self.slot_bytes() / 2**20, lora.max_cpu_loras)

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, data: NewRequestData) -> None:
        self.remove_request(data.req_id)  # a request set up again after a failed step
        lr: LoRARequest | None = getattr(data, "lora_request", None)
        if lr is None:
            return
        resident = self._paths.get(lr.lora_int_id)
        if resident is not None and resident != lr.lora_path and self.slots.forget(lr.lora_int_id) is None:
            raise ValueError(f"LoRA adapter id {lr.lora_int_id} is in use with folder {resident!r}, so it cannot "
                             f"name {lr.lora_path!r} too: one lora_int_id must name one folder")
        weights = self.host.get((lr.lora_int_id, lr.lora_path))  # read and checked before any slot changes
        slot, write = self.slots.acquire(lr.lora_int_id)
        if write:
            self._write(slot, weights)
            self.slot_writes += 1
            kept = self.slots.resident()
            self._paths = {a: p for a, p in self._paths.items() if a in kept}
            self._paths[lr.lora_int_id] = lr.lora_path
            logger.debug("LoRA adapter %s (id %d) -> slot %d", lr.lora_name, lr.lora_int_id, slot)
        self._requests[data.req_id] = (lr.lora_int_id, slot)

    def remove_request(self, req_id: str) -> None:
        held = self._requests.pop(req_id, None)
        if held is not None:
            self.slots.release(held[0])

    def slot_of(self, req_id: str) -> int:
        held = self._requests.get(req_id)
        return 0 if held is None else held[1]

    def _write(self, slot: int, adapter: LoRAWeights) -> None:
        for (layer, fused), slots in self.layers.items():
            subs, style = FUSED_TARGETS[fused]
            parts = []
            for sub, size in zip(subs, slots.sizes):
                pair = adapter.weights.get((layer, sub))
                if pair is not None:
                    a, b = pair
                    if style == "column":  # this rank's output rows of B
                        b = shard_tensor(b, (size, b.shape[1]))
                    else:  # this rank's input columns of A
                        a = shard_tensor(a, (a.shape[0], slots.lora_a.shape[-1]))
                    pair = (a.to(slots.lora_a.dtype), b.to(slots.lora_b.dtype))
                parts.append(pair)
            slots.write(slot, parts)

    # -- model inputs ----------------------------------------------------------------------------
    def prefill_kwargs(self, chunks: list[ScheduledChunk], x: PrefillArrays) -> dict:
        per_chunk = np.array([self.slot_of(c.req_id) for c in chunks] + [0], np.int64)  # [-1]: padding's 0
        return {INDEX: torch.from_numpy(per_chunk[x.query_seq]).to(self.device)}

    def row_extras(self, req_ids: list[str], rows: int) -> dict[str, np.ndarray]:
        out = np.zeros(rows, np.int64)
        out[:len(req_ids)] = [self.slot_of(r) for r in req_ids]
        return {INDEX: out}

    def slot_extras(self) -> dict[str, torch.dtype]:
        return {INDEX: torch.int64}

    def slot_values(self, req_id: str) -> dict[str, int]:
        return {INDEX: self.slot_of(req_id)}

    # -- set-up ----------------------------------------------------------------------------------
    def slot_bytes(self) -> int:
        return sum(t.nbytes for s in self.layers.values() for t in (s.lora_a, s.lora_b))

    def reserved_bytes(self) -> int:
        """The device slots, and the host copies (fp32) of max_cpu_loras adapters of the largest rank."""
        per_adapter = self.slot_bytes() // (self.config.max_loras + 1)
        elem = next(iter(self.layers.values())).lora_a.element_size()
        return self.slot_bytes() + self.config.max_cpu_loras * per_adapter * 4 // elem

    def graph_options(self) -> dict:
        return {"lora": {"max_loras": self.config.max_loras, "max_lora_rank": self.config.max_lora_rank}}
