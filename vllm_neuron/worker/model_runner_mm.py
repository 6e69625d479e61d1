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

from vllm_neuron.model.qwen3_vl.mrope import VisionRun, mrope_positions, rope_positions_for
from vllm_neuron.model.qwen3_vl.preprocessing import vision_inputs
from vllm_neuron.step import ModelRunnerOutput, SchedulerOutput
from vllm_neuron.worker.encoder_cache import EncoderCache
from vllm_neuron.worker.graphs_mm import MultimodalStepGraphs
from vllm_neuron.worker.model_runner_v1 import ModelRunnerV1

DEFAULT_ENCODER_CACHE_BYTES = 256 * 2**20


@dataclass
class _MediaState:
    items: list  # MultiModalItem
    rope: np.ndarray  # [3, prompt length]
    delta: int


class MultimodalRunnerV1(ModelRunnerV1):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.media: dict[str, _MediaState] = {}
        self.encoder_cache = EncoderCache(DEFAULT_ENCODER_CACHE_BYTES)
        self.num_encoder_runs = 0

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
        """mm_hash -> (embeds, deepstack) for `items`: from the encoder cache, else one vision-tower call
        for all the missing ones."""
        out, missing = {}, {}
        for item in items:
            if item.mm_hash in out or item.mm_hash in missing:
                continue
            hit = self.encoder_cache.get(item.mm_hash)
            if hit is not None:
                out[item.mm_hash] = hit
            else:
                missing[item.mm_hash] = item
        if not missing:
            return out
        todo = list(missing.values())
        vi = vision_inputs(self.model.mm_arch.vision, [torch.from_numpy(i.pixel_values) for i in todo],
                           [i.grid_thw for i in todo])
        with torch.inference_mode():
            embeds, deepstack = self.graphs.encode(*(t.to(self.device) for t in vi.tensors()))
        self.num_encoder_runs += 1
        start = 0
        for item in todo:
            n = item.num_tokens
            value = (embeds[start:start + n].clone(), deepstack[:, start:start + n].clone())
            self.encoder_cache.put(item.mm_hash, *value)
            out[item.mm_hash] = value
            start += n
        return out

    # -- decode ----------------------------------------------------------------------------------
    def _decode_extra(self, chunks, x) -> tuple:
        delta = np.zeros(x.positions.shape[0], dtype=np.int64)
        for i, c in enumerate(chunks):
            state = self.media.get(c.req_id)
            if state is not None:
                delta[i] = state.delta
        return (self._t(delta),)
