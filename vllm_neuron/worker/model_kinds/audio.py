"""An audio model's state (Qwen3-ASR): audio encoding during prefill and its outputs placed at the
`<|audio_pad|>` placeholders; on both model runners, beside the vision state (multimodal.py).

Per request it keeps the clips (multimodal/inputs.AudioItem). A prefill step first encodes the clips of
its chunks that the encoder cache lacks: each clip's attention windows take one block each, and the clips
are grouped into one compiled encoder graph per block bucket `encoder_a{blocks}` (warmed up and cached like
the text graphs). Then it fills the embedding rows of the chunk's placeholder tokens (a segment of a
segmented prefill takes only its own rows) and their mask. Positions are 1-D: decode needs nothing.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_neuron.config import buckets as B
from vllm_neuron.model.qwen3_asr.config import AudioArchConfig, audio_encoder_buckets
from vllm_neuron.model.qwen3_asr.features import audio_blocks
from vllm_neuron.model.qwen3_asr.model import AudioEmbeds
from vllm_neuron.step import NewRequestData, ScheduledChunk
from vllm_neuron.worker.input_builder import PrefillArrays
from vllm_neuron.worker.model_kinds.base import EncoderKindState, GraphSpec
from vllm_neuron.worker.encoder_cache import EncoderCacheLayout
from vllm_neuron.worker.step_inputs import AudioEncoderInputs

DEFAULT_AUDIO_CACHE_BYTES = 64 * 2**20


class AudioState(EncoderKindState):
    what = "audio"

    def __init__(self, config, hf_config, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 graph: Callable[[str, int, int], Callable]) -> None:
        """graph(kind, size, context): the runner's compiled graph of a bucket."""
        self.model, self.dtype, self.device, self.graph = model, dtype, device, graph
        self.cfg: AudioArchConfig = model.mm_arch.audio
        self.buckets = audio_encoder_buckets(config.additional_config, self.cfg)
        self.clips: dict[str, list] = {}
        # A block: one attention window's embeddings; the budget: a prefill step's tokens, or the largest
        # encoder bucket's output when that is more.
        layout = EncoderCacheLayout(self.cfg.window_tokens, model.arch.hidden_size, 0, dtype)
        budget = max(config.max_num_batched_tokens, self.buckets[-1] * self.cfg.window_tokens)
        super().__init__(config, layout, budget, DEFAULT_AUDIO_CACHE_BYTES, device)

    # -- set-up ---------------------------------------------------------------------------------------
    def graph_specs(self) -> list[GraphSpec]:
        if self.language_model_only:
            return []
        return [GraphSpec(f"encoder_a{b}", "encode_audio", b, 0) for b in self.buckets]

    def warm(self, spec: GraphSpec) -> None:
        self._run_encoder(spec.size, audio_blocks(self.cfg, [], spec.size))

    def graph_options(self) -> dict:
        return {"language_model_only": self.language_model_only, "audio_buckets": self.buckets}

    # -- requests -------------------------------------------------------------------------------------
    def add_request(self, data: NewRequestData) -> None:
        if data.mm_items:
            self.clips[data.req_id] = list(data.mm_items)

    def remove_request(self, req_id: str) -> None:
        self.clips.pop(req_id, None)

    # -- prefill --------------------------------------------------------------------------------------
    def prefill_kwargs(self, chunks: list[ScheduledChunk], x: PrefillArrays) -> dict:
        n = x.input_ids.shape[0]
        embeds = torch.zeros(n, self.model.arch.hidden_size, dtype=self.dtype)
        mask = np.zeros(n, dtype=bool)
        work = [self._overlapping(c) for c in chunks]
        encoded = self._encode([item for found in work for item, _ in found])
        t = 0
        for c, found in zip(chunks, work):
            for item, sel in found:
                tp = item.token_positions()
                dest = t + tp[sel] - c.start_pos
                embeds[torch.from_numpy(dest)] = encoded[item.mm_hash][torch.from_numpy(np.flatnonzero(sel))].to(
                    self.dtype)
                mask[dest] = True
            t += len(c.token_ids)
        return {"mm": AudioEmbeds(embeds.to(self.device), torch.from_numpy(mask).to(self.device))}

    def _overlapping(self, chunk: ScheduledChunk) -> list[tuple]:
        """(clip, selection of its rows in this chunk) for the chunk's clips."""
        start, end = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
        out = []
        for item in self.clips.get(chunk.req_id, ()):
            tp = item.token_positions()
            sel = (tp >= start) & (tp < end)
            if sel.any():
                out.append((item, sel))
        return out

    def _run_encoder(self, size: int, blocks) -> torch.Tensor:
        x = AudioEncoderInputs(blocks.mel.to(self.device), blocks.chunk_len.to(self.device))
        with torch.inference_mode():
            return self.graph("encode_audio", size, 0)(x)

    def _encode(self, items: list) -> dict:
        """mm_hash -> embeddings [tokens, hidden] for `items`: from the encoder cache, else from encoder calls
        on groups of the missing clips (one call per group whose windows fit the largest bucket)."""
        hits, missing = self.cached(items)
        out = {h: value[0] for h, value in hits.items()}
        for group in self._groups(list(missing.values())):
            need = sum(self.cfg.num_windows(i.mel.shape[1]) for i in group)
            size = B.select_bucket(self.buckets, need)
            blocks = audio_blocks(self.cfg, [i.mel for i in group], size)
            rows = self._run_encoder(size, blocks)[blocks.token_rows.to(self.device)]
            self.num_encoder_runs += 1
            start = 0
            for item in group:
                value = rows[start:start + item.num_tokens].clone()
                self.encoder_cache.put(item.mm_hash, value)
                out[item.mm_hash] = value
                start += item.num_tokens
        return out

    def _groups(self, items: list) -> list[list]:
        """Clips in order, cut into groups whose windows fit the largest bucket."""
        groups: list[list] = []
        used = 0
        for item in items:
            n = self.cfg.num_windows(item.mel.shape[1])
            if n > self.buckets[-1]:
                raise ValueError(f"an audio clip of {item.mel.shape[1]} mel frames needs {n} encoder blocks; the "
                                 f"largest num_encoder_input_buckets entry is {self.buckets[-1]}")
            if groups and used + n <= self.buckets[-1]:
                groups[-1].append(item)
                used += n
            else:
                groups.append([item])
                used = n
        return groups
