"""A model kind's state: what one kind of model (multimodal, and later audio, pooling, LoRA) keeps per request
and adds to each step, as one object the runners call at fixed points instead of a runner subclass.

Both runners call, in this order:
* at set-up: `graph_specs` (graphs of its own beside the step graphs, e.g. an encoder's buckets, warmed up
  through `warm`), `reserved_bytes` (memory it holds beside the weights, taken from the KV budget),
  `graph_options` (what of it shapes the graphs: part of the compile-cache key);
* every step, before the graph: `add_request` / `remove_request` for the step's joins and leaves, then the
  named model inputs of the step: `prefill_kwargs` (a prefill's, built from the step's host arrays) and
  `row_extras` (per decode row, MRv1) or, on Model Runner V2, `slot_values` when a request takes a batch
  slot (kept in the slot state's `extras`, named by `slot_extras`, and gathered per row inside the graph).

The graphs hand these inputs to the model's forward as keyword arguments, so the model names them.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from vllm_neuron.logger import init_logger
from vllm_neuron.step import NewRequestData, ScheduledChunk
from vllm_neuron.config.neuron_config import EncoderNeuronConfig
from vllm_neuron.worker.encoder_cache import EncoderCache, EncoderCacheLayout, encoder_cache_blocks
from vllm_neuron.worker.input_builder import PrefillArrays

logger = init_logger(__name__)


class GraphSpec(NamedTuple):
    """One graph warm-up compiles: its bucket name, kind (prefill / decode / verify / a kind's own), size and
    context."""

    name: str
    kind: str
    size: int
    context: int


class ModelKindState:
    # Where a kind with its own encoder graphs hands the tensors tensor capture tapped in them
    # (worker/tensor_debug.py's write_media); set by the runner, None without capture.
    capture_sink = None

    def add_request(self, data: NewRequestData) -> None:
        pass

    def remove_request(self, req_id: str) -> None:
        pass

    def prefill_kwargs(self, chunks: list[ScheduledChunk], x: PrefillArrays) -> dict:
        """Model inputs of a prefill step (device tensors, fixed shapes per bucket)."""
        return {}

    def row_extras(self, req_ids: list[str], rows: int) -> dict[str, np.ndarray]:
        """Per-row model inputs of a decode step ([rows] each; padded rows past len(req_ids))."""
        return {}

    def slot_extras(self) -> dict[str, torch.dtype]:
        """Names and dtypes of the per-slot model inputs kept in Model Runner V2's slot state."""
        return {}

    def slot_values(self, req_id: str) -> dict[str, float | int]:
        """A request's values of `slot_extras`, written when it takes a batch slot."""
        return {}

    def graph_specs(self) -> list[GraphSpec]:
        return []

    def warm(self, spec: GraphSpec) -> None:
        """Runs one of `graph_specs` once on padding (warm-up compiles or loads it)."""
        raise NotImplementedError

    def reserved_bytes(self) -> int:
        return 0

    def graph_options(self) -> dict:
        return {}

    def encoder_cache_stats(self) -> tuple[int, int, int] | None:
        """(hits, misses, evictions) of the encoder cache, for a kind that has one."""
        return None


def epd_role(config) -> bool:
    """Whether this engine is one half of an encoder-disaggregated (EPD) deployment."""
    return bool(config.additional_config.mm_language_model_only or config.mm_encoder_only
                or config.ec_transfer_config is not None)


class EncoderKindState(ModelKindState):
    """What a kind with an encoder of its own (vision, audio) shares: the encoder cache keyed by media hash
    (reserved in the memory budget, its hits and misses on /metrics), the count of encoder calls, and the
    text-tower-only switch that leaves the encoder graphs out."""

    what = "media"  # what the cache holds, for the start-up line

    def __init__(self, config, layout: EncoderCacheLayout, budget_tokens: int, default_bytes: int,
                 device: torch.device) -> None:
        """`budget_tokens`: the most media tokens one step can need (the cache's floor); `default_bytes`: the
        cache's size when encoder_cache_num_blocks is not given (see encoder_cache.encoder_cache_blocks)."""
        ac = config.additional_config
        enc = ac.encoder_neuron_config or EncoderNeuronConfig()
        blocks, self.cache_sizing = encoder_cache_blocks(enc.encoder_cache_num_blocks, budget_tokens, default_bytes,
                                                         layout)
        self.encoder_cache = EncoderCache(layout, blocks, hold_time_ms=enc.min_hold_time_ms(epd_role(config)),
                                          device=device)
        self.num_encoder_runs = 0
        self.language_model_only = ac.mm_language_model_only

    def reserved_bytes(self) -> int:
        cache = self.encoder_cache
        logger.info("Encoder cache: %d blocks of %d %s tokens, %.1f MiB (reserved in the memory budget; %s), "
                    "hold time %.0f ms", cache.num_blocks, cache.layout.block_tokens, self.what,
                    cache.max_bytes / 2**20, self.cache_sizing, cache.hold_s * 1000)
        return cache.max_bytes

    def encoder_cache_stats(self) -> tuple[int, int, int]:
        return self.encoder_cache.hits, self.encoder_cache.misses, self.encoder_cache.evictions

    def cached(self, items: list) -> tuple[dict, dict]:
        """({mm_hash: cached value}, {mm_hash: item the cache lacks}) for `items` (each hash once)."""
        out, missing = {}, {}
        for item in items:
            if item.mm_hash in out or item.mm_hash in missing:
                continue
            hit = self.encoder_cache.get(item.mm_hash)
            if hit is not None:
                out[item.mm_hash] = hit
            else:
                missing[item.mm_hash] = item
        return out, missing
