"""Model Runner V1 for a multimodal model: vision encoding during prefill, its outputs placed at the
media placeholders, M-RoPE positions and the decode delta.

Per request the runner keeps the media items and the prompt's M-RoPE positions (computed once from the
items' grids). A prefill step first encodes the media of its chunks that the encoder cache lacks (one
vision-tower call for all of them), then fills fixed-shape inputs: the embedding rows of the chunk's
placeholder tokens (a segment of a segmented prefill takes only its own rows), the deepstack rows, the
mask and the rotary positions. Decode steps encode nothing; they add each row's rotary delta.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_neuron.config import buckets as B
from vllm_neuron.config.neuron_config import EncoderNeuronConfig
from vllm_neuron.logger import init_logger
from vllm_neuron.model.qwen3_vl.block_packing import check_buckets, pack_ffd
from vllm_neuron.model.qwen3_vl.mrope import VisionRun, mrope_positions, rope_positions_for
from vllm_neuron.model.qwen3_vl.preprocessing import vision_inputs
from vllm_neuron.step import ModelRunnerOutput, SchedulerOutput
from vllm_neuron.worker.encoder_cache import EncoderCache
from vllm_neuron.worker.graphs_mm import MultimodalStepGraphs
from vllm_neuron.worker.model_runner_v1 import ModelRunnerV1

logger = init_logger(__name__)
DEFAULT_ENCODER_CACHE_BYTES = 256 * 2**20


@dataclass
class _MediaState:
    items: list  # MultiModalItem
    rope: np.ndarray  # [3, prompt length]
    delta: int


def encoder_settings(config, hf_config) -> tuple[int, list[int]]:
    """(encoder_attention_block_size, encoder input buckets) in patches, from encoder_neuron_config: the
    default buckets double from the block size up to what max_model_len tokens of media hold."""
    enc = config.additional_config.encoder_neuron_config or EncoderNeuronConfig()
    block = enc.encoder_attention_block_size
    merge_unit = hf_config.vision_config.spatial_merge_size ** 2
    return block, check_buckets(enc.input_buckets(config.max_model_len * merge_unit), block)


class MultimodalRunnerV1(ModelRunnerV1):
    def __init__(self, config, checkpoint, *args, **kwargs) -> None:
        super().__init__(config, checkpoint, *args, **kwargs)
        self.media: dict[str, _MediaState] = {}
        self.encoder_block, self.encoder_buckets = encoder_settings(config, checkpoint.hf_config)
        enc = config.additional_config.encoder_neuron_config
        nbytes = DEFAULT_ENCODER_CACHE_BYTES
        if enc is not None and enc.encoder_cache_num_blocks:  # a block: one attention block's merged tokens
            text, vision = checkpoint.hf_config.get_text_config(), checkpoint.hf_config.vision_config
            per_token = text.hidden_size * (1 + len(vision.deepstack_visual_indexes)) * self.dtype.itemsize
            nbytes = enc.encoder_cache_num_blocks * self.encoder_block // vision.spatial_merge_size ** 2 * per_token
        self.encoder_cache = EncoderCache(nbytes)
        self.num_encoder_runs = 0
        self.language_model_only = config.additional_config.mm_language_model_only

    def graph_names(self) -> list[tuple[str, str, int, int]]:
        out = super().graph_names()
        if not self.language_model_only:  # one vision-tower graph per encoder bucket
            out += [(self._graph_name("encode", b, 0), "encode", b, 0) for b in self.encoder_buckets]
        return out

    def _graph_name(self, kind: str, size: int, context: int) -> str:
        return f"encoder_p{size}" if kind == "encode" else super()._graph_name(kind, size, context)

    def _run_encode(self, chunks, size: int, context: int, vi=None):
        """One encoder bucket's graph; warm-up runs it on padding only."""
        if vi is None:
            vision = self.model.mm_arch.vision
            seg = torch.full((size // self.encoder_block, self.encoder_block), -1, dtype=torch.long)
            args = (torch.zeros(size, vision.patch_dim), torch.zeros(size, 4, dtype=torch.long),
                    torch.zeros(size, 4), torch.zeros(size, 2, dtype=torch.long), seg)
        else:
            args = vi.tensors()
        with torch.inference_mode():
            return self._graph("encode", size, 0)(*(t.to(self.device) for t in args))

    def num_blocks(self, weight_bytes: int) -> int:
        """The encoder cache's bound is reserved beside the weights before the KV pool is sized."""
        logger.info("Encoder cache: up to %.1f MiB of vision embeddings (reserved in the memory budget)",
                    self.encoder_cache.max_bytes / 2**20)
        return super().num_blocks(weight_bytes + self.encoder_cache.max_bytes)

    def encoder_cache_stats(self) -> tuple[int, int]:
        return self.encoder_cache.hits, self.encoder_cache.misses

    def _make_graphs(self) -> MultimodalStepGraphs:
        return MultimodalStepGraphs(self.model, self.odsc, self.block_size, self.use_kernels, self.paged_decode)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids:
            self.media.pop(rid, None)
        for data in sched.new_requests:
            if data.mm_items:
                runs = [VisionRun(o, g) for item in data.mm_items for o, g in item.runs]
                rope, delta = mrope_positions(len(data.prompt_token_ids), runs)
                self.media[data.req_id] = _MediaState(data.mm_items, rope, delta)
        return super().execute(sched)

    # -- prefill ---------------------------------------------------------------------------------
    def _run_prefill(self, chunks, num_tokens: int, num_context: int, masks: dict | None = None):
        def row_inputs(rows: int) -> tuple:
            s = self.sampling.graph_tensors([c.req_id for c in chunks], rows)
            return tuple(self._t(s[k]) for k in ("temperature", "top_k", "top_p", "uniform"))
        return self._prefill_graph(chunks, num_tokens, num_context, masks, row_inputs,
                                   lambda x: self._media_inputs(chunks, x))

    def _overlapping(self, chunk) -> list[tuple]:
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

    def _media_inputs(self, chunks, x) -> tuple:
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
        return (self._t(rope), embeds.to(self.device), self._t(mask), deepstack.to(self.device))

    def _encode(self, items: list) -> dict:
        """mm_hash -> (embeds, deepstack) for `items`: from the encoder cache, else from vision-tower calls
        on block-packed groups of the missing ones (one call per group that fits the largest bucket)."""
        out, missing = {}, {}
        for item in items:
            if item.mm_hash in out or item.mm_hash in missing:
                continue
            hit = self.encoder_cache.get(item.mm_hash)
            if hit is not None:
                out[item.mm_hash] = hit
            else:
                missing[item.mm_hash] = item
        for group in self._encoder_groups(list(missing.values())):
            n_blocks = len(pack_ffd(_frame_sizes(group), self.encoder_block))
            size = B.select_bucket(self.encoder_buckets, n_blocks * self.encoder_block)
            vi = vision_inputs(self.model.mm_arch.vision, [torch.from_numpy(i.pixel_values) for i in group],
                               [i.grid_thw for i in group], num_patches=size, block_size=self.encoder_block)
            embeds, deepstack = self._run_encode([], size, 0, vi)
            rows = vi.token_rows.to(embeds.device)
            embeds, deepstack = embeds[rows], deepstack[:, rows]  # back to item order
            self.num_encoder_runs += 1
            start = 0
            for item in group:
                n = item.num_tokens
                value = (embeds[start:start + n].clone(), deepstack[:, start:start + n].clone())
                self.encoder_cache.put(item.mm_hash, *value)
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

    # -- decode ----------------------------------------------------------------------------------
    def _decode_extra(self, chunks, x) -> tuple:
        delta = np.zeros(x.positions.shape[0], dtype=np.int64)
        for i, c in enumerate(chunks):
            state = self.media.get(c.req_id)
            if state is not None:
                delta[i] = state.delta
        return (self._t(delta),)


def _frame_sizes(items: list) -> list[int]:
    """Patches of each attention segment (an image, or a video frame) of `items`."""
    return [item.grid_thw[1] * item.grid_thw[2] for item in items for _ in range(item.grid_thw[0])]
