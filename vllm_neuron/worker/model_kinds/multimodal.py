"""A multimodal model's state (Qwen3-VL): vision encoding during prefill, its outputs placed at the media
placeholders, M-RoPE positions and the decode delta; on both model runners.

Per request it keeps the media items and the prompt's M-RoPE positions (computed once from the items'
grids). A prefill step first encodes the media of its chunks that the encoder cache lacks (block-packed into
one compiled encoder graph per bucket `encoder_p{patches}`, warmed up and cached like the text graphs), then
fills fixed-shape inputs: the embedding rows of the chunk's placeholder tokens (a segment of a segmented
prefill takes only its own rows), the deepstack rows, the mask and the rotary positions. Decode steps encode
nothing; each row adds its request's rotary delta (per row on MRv1, per slot on MRv2).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_neuron.config import buckets as B
from vllm_neuron.config.neuron_config import EncoderNeuronConfig
from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.model.qwen3_vl.block_packing import check_buckets, pack_ffd
from vllm_neuron.model.qwen3_vl.model import MultimodalEmbeds
from vllm_neuron.model.qwen3_vl.mrope import VisionRun, mrope_positions, rope_positions_for
from vllm_neuron.model.qwen3_vl.preprocessing import vision_inputs
from vllm_neuron.step import NewRequestData, ScheduledChunk
from vllm_neuron.worker.ec_consumer import remote_embeddings
from vllm_neuron.worker.input_builder import PrefillArrays
from vllm_neuron.worker.model_kinds.base import EncoderKindState, GraphSpec
from vllm_neuron.worker.encoder_cache import EncoderCacheLayout
from vllm_neuron.worker.step_inputs import EncoderInputs

DEFAULT_ENCODER_CACHE_BYTES = 256 * 2**20


@dataclass
class _Media:
    items: list  # MultiModalItem
    rope: np.ndarray  # [3, prompt length]
    delta: int


def encoder_settings(config, hf_config, world: int = 1) -> tuple[int, list[int], tuple[int, int]]:
    """(encoder_attention_block_size, encoder input buckets in patches, encoder (tp, dp) over `world` ranks),
    from encoder_neuron_config: the default buckets double from the block size up to what max_model_len
    tokens of media hold; with encoder DP each bucket is rounded up to whole blocks for every DP rank."""
    enc = config.additional_config.encoder_neuron_config or EncoderNeuronConfig()
    block = enc.encoder_attention_block_size
    merge_unit = hf_config.vision_config.spatial_merge_size ** 2
    buckets = check_buckets(enc.input_buckets(config.max_model_len * merge_unit), block)
    tp, dp = enc.parallel_sizes(world)
    return block, sorted({-(-b // (block * dp)) * block * dp for b in buckets}), (tp, dp)


class MultimodalState(EncoderKindState):
    what = "vision"

    def __init__(self, config, hf_config, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 graph: Callable[[str, int, int], Callable]) -> None:
        """graph(kind, size, context): the runner's compiled graph of a bucket."""
        self.model, self.dtype, self.device, self.graph = model, dtype, device, graph
        self.media: dict[str, _Media] = {}
        self.encoder_block, self.encoder_buckets, self.encoder_parallel = encoder_settings(config, hf_config,
                                                                                           ps.info().world)
        text, vision = hf_config.get_text_config(), hf_config.vision_config
        merge_unit = vision.spatial_merge_size ** 2
        # A block: one encoder attention block's merged tokens; the budget: a prefill step's tokens, or the
        # largest encoder bucket's output when that is more.
        layout = EncoderCacheLayout(self.encoder_block // merge_unit, text.hidden_size,
                                    len(vision.deepstack_visual_indexes), dtype)
        budget = max(config.max_num_batched_tokens, self.encoder_buckets[-1] // merge_unit)
        super().__init__(config, layout, budget, DEFAULT_ENCODER_CACHE_BYTES, device)
        self.remote = remote_embeddings(config, hf_config)  # EPD: embeddings an encoder instance wrote

    # -- set-up ---------------------------------------------------------------------------------------
    def graph_specs(self) -> list[GraphSpec]:
        if self.language_model_only:
            return []
        return [GraphSpec(f"encoder_p{b}", "encode", b, 0) for b in self.encoder_buckets]

    def warm(self, spec: GraphSpec) -> None:
        vision, size = self.model.mm_arch.vision, spec.size
        seg = torch.full((size // self.encoder_block, self.encoder_block), -1, dtype=torch.long)
        self._run_encoder(size, EncoderInputs(torch.zeros(size, vision.patch_dim),
                                              torch.zeros(size, 4, dtype=torch.long), torch.zeros(size, 4),
                                              torch.zeros(size, 2, dtype=torch.long), seg))

    def graph_options(self) -> dict:
        return {"language_model_only": self.language_model_only, "encoder_parallel": self.encoder_parallel}

    # -- requests -------------------------------------------------------------------------------------
    def add_request(self, data: NewRequestData) -> None:
        if data.mm_items:
            runs = [VisionRun(o, g) for item in data.mm_items for o, g in item.runs]
            rope, delta = mrope_positions(len(data.prompt_token_ids), runs)
            self.media[data.req_id] = _Media(data.mm_items, rope, delta)

    def remove_request(self, req_id: str) -> None:
        self.media.pop(req_id, None)

    def row_extras(self, req_ids: list[str], rows: int) -> dict[str, np.ndarray]:
        delta = np.zeros(rows, dtype=np.int64)
        for i, rid in enumerate(req_ids):
            state = self.media.get(rid)
            if state is not None:
                delta[i] = state.delta
        return {"rope_delta": delta}

    def slot_extras(self) -> dict[str, torch.dtype]:
        return {"rope_delta": torch.int64}

    def slot_values(self, req_id: str) -> dict[str, int]:
        state = self.media.get(req_id)
        return {"rope_delta": state.delta if state is not None else 0}

    # -- prefill --------------------------------------------------------------------------------------
    def prefill_kwargs(self, chunks: list[ScheduledChunk], x: PrefillArrays) -> dict:
        n = x.input_ids.shape[0]
        hidden = self.model.arch.hidden_size
        rope = np.repeat(x.positions[None], 3, axis=0)
        embeds = torch.zeros(n, hidden, dtype=self.dtype)
        deepstack = torch.zeros(self.model.num_deepstack, n, hidden, dtype=self.dtype)
        mask = np.zeros(n, dtype=bool)
        work = [(i, self._overlapping(c)) for i, c in enumerate(chunks)]
        encoded = self._encode([item for _, found in work for item, _, _ in found])
        t = 0
        for i, c in enumerate(chunks):
            state = self.media.get(c.req_id)
            m = len(c.token_ids)
            if state is not None:
                rope[:, t:t + m] = rope_positions_for(x.positions[t:t + m], state.rope, state.delta)
            for item, tp, sel in work[i][1]:
                emb, ds = encoded[item.mm_hash]
                dest = torch.from_numpy(t + tp[sel] - c.start_pos)
                rows = torch.from_numpy(np.flatnonzero(sel))
                embeds[dest] = emb[rows].to(self.dtype)
                deepstack[:, dest] = ds[:, rows].to(self.dtype)
                mask[dest.numpy()] = True
            t += m
        d = self.device
        return {"mm": MultimodalEmbeds(torch.from_numpy(rope).to(d), embeds.to(d), torch.from_numpy(mask).to(d),
                                       deepstack.to(d))}

    def _overlapping(self, chunk: ScheduledChunk) -> list[tuple]:
        """(item, its token positions, selection of rows in this chunk) for the chunk's media."""
        state = self.media.get(chunk.req_id)
        if state is None:
            return []
        start, end = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
        out = []
        for item in state.items:
            tp = item.token_positions()
            sel = (tp >= start) & (tp < end)
            if sel.any():
                out.append((item, tp, sel))
        return out

    def _run_encoder(self, size: int, x: EncoderInputs) -> tuple:
        """(embeds, deepstack, the tapped tensors or None) of one encoder bucket."""
        x = EncoderInputs(*(t.to(self.device) for t in (x.pixels, x.interp_idx, x.interp_w, x.rot_pos, x.segment)))
        with torch.inference_mode():
            out = self.graph("encode", size, 0)(x)
        return out if len(out) == 3 else (*out, None)

    def _encode(self, items: list) -> dict:
        """mm_hash -> (embeds, deepstack) for `items`: from the encoder cache, else from vision-tower calls
        on block-packed groups of the missing ones (one call per group that fits the largest bucket)."""
        out, missing = self.cached(items)
        if self.remote is not None:
            found, missing = self.remote.fetch(missing, can_encode=not self.language_model_only)
            for h, value in found.items():
                self.encoder_cache.put(h, *value)
                out[h] = value
        for group in self._encoder_groups(list(missing.values())):
            n_blocks = len(pack_ffd(_frame_sizes(group), self.encoder_block))
            size = B.select_bucket(self.encoder_buckets, n_blocks * self.encoder_block)
            vi = vision_inputs(self.model.mm_arch.vision, [torch.from_numpy(i.pixel_values) for i in group],
                               [i.grid_thw for i in group], num_patches=size, block_size=self.encoder_block)
            embeds, deepstack, captured = self._run_encoder(size, EncoderInputs(*vi.tensors()))
            if captured and self.capture_sink is not None:
                self.capture_sink(f"encoder_p{size}", size, group, captured, vi.patch_rows, vi.token_rows)
            rows = vi.token_rows.to(embeds.device)
            embeds, deepstack = embeds[rows], deepstack[:, rows]  # back to item order
            self.num_encoder_runs += 1
            start = 0
            for item in group:
                n = item.num_tokens
                value = (embeds[start:start + n].clone(), deepstack[:, start:start + n].clone())
                self.encoder_cache.put(item.mm_hash, *value)
                if self.remote is not None:
                    self.remote.computed(item.mm_hash, *value)
                out[item.mm_hash] = value
                start += n
        return out

    def _encoder_groups(self, items: list) -> list[list]:
        """Items in order, cut into groups whose packed blocks fit the largest encoder bucket."""
        groups: list[list] = []
        for item in items:
            trial = (groups[-1] if groups else []) + [item]
            if groups and len(pack_ffd(_frame_sizes(trial), self.encoder_block)) * self.encoder_block \
                    <= self.encoder_buckets[-1]:
                groups[-1] = trial
            else:
                groups.append([item])
        return groups


def _frame_sizes(items: list) -> list[int]:
    """Patches of each attention segment (an image, or a video frame) of `items`."""
    return [item.grid_thw[1] * item.grid_thw[2] for item in items for _ in range(item.grid_thw[0])]
