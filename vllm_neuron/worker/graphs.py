"""The per-bucket graph functions: one step-input dataclass in (worker/step_inputs.py), a `StepOutput` out,
nothing of requests or the host.

They live apart from the model runners so that what a compiled graph closes over is only the model, a few
static options and a speculator's in-graph part. The compile cache serializes each bucket's compiled function
together with a snapshot of that closure for its guards, and the runner (RNG generators, host state) would
not survive the round trip.

`StepGraphs` are Model Runner V1's (host-built inputs), `SlotStepGraphs` Model Runner V2's (per-request state
in slot tensors that the graph reads and updates); both share the pieces of `GraphBase`. A speculator's
draft model runs inside every graph through its `DraftGraphs` part (worker/spec_decode/): the target's
forward taps the layers it names, and after sampling the draft proposes the next step's drafts.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_neuron.config.neuron_config import OnDeviceSamplingConfig
from vllm_neuron.model.layers.attention import (AttentionMetadata, context_positions, decode_mask, prefill_mask,
                                                verify_mask)
from vllm_neuron.model.layers.in_graph_sampler import (apply_token_bitmask, greedy_in_graph, sample_in_graph,
                                                       sample_slots)
from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.model.layers.rejection_sampler import rejection_sample
from vllm_neuron.worker.step_inputs import (AudioEncoderInputs, DecodeInputs, EncoderInputs, PrefillInputs,
                                            PromptLogprobsOut, PromptRows, RowSampling, SlotDecodeInputs, SlotState,
                                            StepOutput, VerifyInputs)

# Prompt logprobs are computed this many positions at a time: [rows, vocab] fp32 logits stay ~25 MB on a
# 49k vocabulary instead of growing with the prompt.
PROMPT_LOGPROBS_ROWS = 128


@dataclass(frozen=True)
class GraphOptions:
    """What shapes the graphs beyond the model (each is part of the compile-cache key, via the runner)."""

    odsc: OnDeviceSamplingConfig | None  # None: CPU sampling (the graphs return logits, tokens are the argmax)
    block_size: int
    kernels: KernelConfig
    paged_decode: bool = False  # CUDA: decode attention by the Triton kernel over each sequence's real context
    kv_segment: int = 0  # kv_segment_size_buckets: the torch prefill reads the context this many slots at a time
    # KV cache groups (kv_cache_groups.py): per layer its group and its K/V tensor pair; None for one group,
    # where kv_caches holds one pair per layer and every layer shares one metadata.
    layer_group: tuple[int, ...] | None = None
    layer_slot: tuple[int, ...] | None = None


class DraftGraphs(Protocol):
    """A speculator's part inside the graphs (worker/spec_decode/): which target layers it taps and what it
    proposes after each kind of step (drafts [rows, K'])."""

    aux_layers: tuple[int, ...]

    def after_prefill(self, g: "GraphBase", x: PrefillInputs, tokens, taps, meta) -> torch.Tensor: ...

    def after_decode(self, g: "GraphBase", x: DecodeInputs, tokens, taps, meta) -> torch.Tensor: ...

    def after_verify(self, g: "GraphBase", x: VerifyInputs, tokens, num_emitted, taps, meta) -> torch.Tensor: ...


def recorded(fn):
    """A graph function whose StepOutput also carries the tensors the model's taps recorded during it
    (neuron_config.tensor_capture): graph outputs like the tokens, so a compiled graph returns them too.
    Only for methods the bucket functions call: a compiled function saved ahead of time cannot be a closure."""

    @functools.wraps(fn)
    def run(self: "GraphBase", x):
        if self.taps is None or not self.taps.captured_names:
            return fn(self, x)
        with self.taps.recording() as rec:
            result = fn(self, x)
        if isinstance(result, tuple):
            return (dataclasses.replace(result[0], captured=rec), *result[1:])
        return dataclasses.replace(result, captured=rec)

    return run


class GraphBase:
    def __init__(self, model: torch.nn.Module, options: GraphOptions, drafter: DraftGraphs | None = None) -> None:
        self.model = model
        self.options = options
        self.drafter = drafter
        self.taps = None  # worker/module_taps.ModuleTaps under tensor capture / replacement (set by the runner)

    # -- attention metadata ------------------------------------------------------------------------
    def prefill_meta(self, x: PrefillInputs) -> AttentionMetadata:
        o = self.options
        if o.kernels.attention:
            return AttentionMetadata(x.slot_mapping, block_tables=x.seq_tables, query_start=x.query_start,
                                     positions=x.positions, block_size=o.block_size, use_kernels=True)
        ctx = x.context_seq
        return AttentionMetadata(x.slot_mapping, prefill_mask(x.positions, x.query_seq, ctx),
                                 context_slots=x.context_slots, positions=x.positions,
                                 context_positions=None if ctx is None else context_positions(ctx),
                                 kv_segment=o.kv_segment)

    def decode_meta(self, slot_mapping, block_tables, positions) -> AttentionMetadata:
        o = self.options
        if o.kernels.attention:
            starts = torch.arange(positions.shape[0] + 1, device=positions.device)
            return AttentionMetadata(slot_mapping, block_tables=block_tables, query_start=starts, positions=positions,
                                     block_size=o.block_size, is_decode=True, use_kernels=True)
        if o.paged_decode:
            return AttentionMetadata(slot_mapping, block_tables=block_tables, positions=positions, is_decode=True,
                                     block_size=o.block_size, paged_decode=True)
        mask = decode_mask(positions + 1, block_tables.shape[1] * o.block_size)
        return AttentionMetadata(slot_mapping, mask, block_tables=block_tables, is_decode=True, positions=positions)

    def rows_meta(self, slot_mapping, block_tables, positions, rows_per_seq: int) -> AttentionMetadata:
        """Decode-shaped attention with `rows_per_seq` causal query rows per sequence (a verification, a
        draft block whose `positions` are each row's attention limit)."""
        o = self.options
        b = block_tables.shape[0]
        if o.kernels.attention:
            starts = torch.arange(b + 1, device=positions.device) * rows_per_seq
            return AttentionMetadata(slot_mapping, block_tables=block_tables, query_start=starts, positions=positions,
                                     block_size=o.block_size, is_decode=True, use_kernels=True)
        mask = verify_mask(positions.view(b, rows_per_seq), block_tables.shape[1] * o.block_size)
        return AttentionMetadata(slot_mapping, mask, block_tables=block_tables, is_decode=True, positions=positions)

    def _group_metas(self, meta: AttentionMetadata, groups, prefill: bool) -> tuple:
        """Metadata of KV cache groups 1..: each GroupTables' slots and tables (block tables, or context slots
        for a torch prefill); masks are shared."""
        field = "context_slots" if prefill and not self.options.kernels.attention else "block_tables"
        return tuple(dataclasses.replace(meta, slot_mapping=g.slot_mapping, **{field: g.tables}) for g in groups)

    # -- the model ----------------------------------------------------------------------------------
    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, group_metas: tuple = (),
                model_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states, the drafter's tapped hidden states or None). With KV cache groups each layer gets
        its group's metadata and the K/V pair it shares with the layers of the same index in other groups."""
        o = self.options
        if o.layer_slot is not None:
            metas = (meta, *group_metas)
            kv_caches = [kv_caches[s] for s in o.layer_slot]
            meta = [metas[g] for g in o.layer_group]
        kwargs = dict(model_kwargs or {})
        if self.drafter is not None and self.drafter.aux_layers:
            return self.model(input_ids, positions, kv_caches, meta, aux_layers=self.drafter.aux_layers, **kwargs)
        return self.model(input_ids, positions, kv_caches, meta, **kwargs), None

    def sample(self, logits, bitmask, s: RowSampling | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(tokens, logits): the grammar mask, then greedy (`s` None) or seeded sampling; no tokens under CPU
        sampling (no on-device sampling config: the host samples every row)."""
        use = self.options.kernels.sampler
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask, use)
        odsc = self.options.odsc
        if odsc is None:
            return None, logits
        if odsc.all_greedy or s is None:
            return greedy_in_graph(logits, use), logits
        return sample_in_graph(logits, s.temperature, s.top_k, s.top_p, s.uniform, odsc.top_k, use_kernels=use), logits

    def prompt_logprobs(self, hidden: torch.Tensor, p: PromptRows) -> PromptLogprobsOut:
        """Log-softmax of the logits at the prompt rows `p` asks for: each target token's logprob and rank
        (tokens at least as likely, so the best is 1, as the host sampler counts), and the top_n."""
        lps, ranks, top_v, top_i = [], [], [], []
        for s in range(0, p.rows.shape[0], PROMPT_LOGPROBS_ROWS):
            # Three passes over the logits, none written back: log_softmax would materialize a second copy.
            logits = self.model.compute_logits(hidden[p.rows[s:s + PROMPT_LOGPROBS_ROWS]]).float()
            lse = torch.logsumexp(logits, -1, keepdim=True)
            target = logits.gather(1, p.targets[s:s + PROMPT_LOGPROBS_ROWS, None])
            lps.append((target - lse)[:, 0])
            ranks.append((logits >= target).sum(-1))
            if p.top_n:
                v, i = logits.topk(min(p.top_n, logits.shape[-1]), dim=-1)
                top_v.append(v - lse)
                top_i.append(i)
        return PromptLogprobsOut(torch.cat(lps), torch.cat(ranks), torch.cat(top_i) if top_i else None,
                                 torch.cat(top_v) if top_v else None)

    def _prefill(self, x: PrefillInputs) -> tuple[StepOutput, torch.Tensor]:
        """(the prefill step's output, the hidden states of all its tokens)."""
        raise NotImplementedError

    def _prefill_kwargs(self, x: PrefillInputs) -> dict:
        """The model's keyword inputs of a prefill; with prompt embeddings a per-row select between them and
        the token embeddings (one graph for both kinds of prompt)."""
        if x.embeds is None:
            return x.model_kwargs
        tokens = self.model.embed_input_ids(x.input_ids)
        return {**x.model_kwargs, "inputs_embeds": torch.where(x.embeds_rows[:, None], x.embeds.to(tokens.dtype),
                                                               tokens)}

    def prefill(self, x: PrefillInputs) -> StepOutput:
        return self._prefill(x)[0]

    def prefill_with_prompt_logprobs(self, x: PrefillInputs, p: PromptRows) -> tuple[StepOutput, PromptLogprobsOut]:
        """The prefill step and the prompt logprobs at `p`'s rows (run eagerly, only for steps that ask)."""
        out, hidden = self._prefill(x)
        return out, self.prompt_logprobs(hidden, p)

    def encode(self, x: EncoderInputs) -> tuple:
        """A multimodal model's encoder over one bucket of block-packed media: (embeds, deepstack), and the
        tapped vision modules' tensors by name when tensor capture names some (rows in packed order)."""
        if self.taps is None or not self.taps.captured_names:
            return self.model.encode(x.pixels, x.interp_idx, x.interp_w, x.rot_pos, x.segment)
        with self.taps.recording() as rec:
            embeds, deepstack = self.model.encode(x.pixels, x.interp_idx, x.interp_w, x.rot_pos, x.segment)
        return embeds, deepstack, rec

    def encode_audio(self, x: AudioEncoderInputs) -> torch.Tensor:
        """An audio model's encoder over one bucket of blocks (one attention window each): [rows, hidden]."""
        return self.model.encode_audio(x.mel, x.chunk_len)


class StepGraphs(GraphBase):
    """Model Runner V1's graphs: host-built inputs; forward, logits of the sampled rows, in-graph sampling."""

    @recorded
    def _prefill(self, x: PrefillInputs) -> tuple[StepOutput, torch.Tensor]:
        meta = self.prefill_meta(x)
        hidden, taps = self.forward(x.input_ids, x.positions, x.kv_caches, meta,
                                    self._group_metas(meta, x.groups, True), self._prefill_kwargs(x))
        tokens, logits = self.sample(self.model.compute_logits(hidden[x.logits_indices]), x.bitmask, x.sampling)
        drafts = None if self.drafter is None else self.drafter.after_prefill(self, x, tokens, taps, meta)
        return StepOutput(tokens, logits, drafts), hidden

    def decode(self, x: DecodeInputs) -> StepOutput:
        return self._decode(x)

    @recorded
    def _decode(self, x: DecodeInputs) -> StepOutput:
        meta = self.decode_meta(x.slot_mapping, x.block_tables, x.positions)
        hidden, taps = self.forward(x.input_ids, x.positions, x.kv_caches, meta,
                                    self._group_metas(meta, x.groups, False), x.row_extras)
        tokens, logits = self.sample(self.model.compute_logits(hidden), x.bitmask, x.sampling)
        drafts = None if self.drafter is None else self.drafter.after_decode(self, x, tokens, taps, meta)
        return StepOutput(tokens, logits, drafts)

    def verify(self, x: VerifyInputs) -> StepOutput:
        return self._verify(x)

    @recorded
    def _verify(self, x: VerifyInputs) -> StepOutput:
        """The target over 1 + K rows per sequence (K/V of the last token and the drafts written in place),
        logits at every row, the grammar mask at every verified position, and the rejection sampler."""
        b, k = x.draft_ids.shape
        meta = self.rows_meta(x.slot_mapping, x.block_tables, x.positions, k + 1)
        hidden, taps = self.forward(x.input_ids, x.positions, x.kv_caches, meta,
                                    self._group_metas(meta, x.groups, False), x.row_extras)
        logits = self.model.compute_logits(hidden).float()
        if x.bitmask is not None:  # [B * (1 + K), words]: the grammar's mask at every verified position
            logits = apply_token_bitmask(logits, x.bitmask, self.options.kernels.sampler)
        logits = logits.view(b, k + 1, -1)
        s, odsc = x.sampling, self.options.odsc
        tokens, num_emitted = rejection_sample(logits, x.draft_ids, x.num_drafts, s.temperature, s.top_k, s.top_p,
                                               x.uniform_accept, x.uniform_sample, all_greedy=odsc.all_greedy,
                                               max_top_k=odsc.top_k)
        drafts = None if self.drafter is None else self.drafter.after_verify(self, x, tokens, num_emitted, taps,
                                                                             meta)
        return StepOutput(tokens, logits[:, 0], drafts, num_emitted)


class SlotStepGraphs(GraphBase):
    """Model Runner V2's graphs: per-request state lives in slot tensors that the graph reads and updates."""

    def _sample_rows(self, logits, bitmask, slots, sample_pos, state: SlotState) -> tuple[torch.Tensor, torch.Tensor]:
        """In-graph tokens of the rows at `slots`; under CPU sampling the argmax stands in until the host's
        token overwrites it."""
        odsc = self.options.odsc
        if odsc is None:
            _, logits = self.sample(logits, bitmask, None)
            return greedy_in_graph(logits, self.options.kernels.sampler), logits
        if odsc.all_greedy:
            return self.sample(logits, bitmask, None)
        use = self.options.kernels.sampler
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask, use)
        return sample_slots(logits, slots, sample_pos, state.temperature, state.top_k, state.top_p, state.seed,
                            odsc.top_k, use_kernels=use), logits

    def _write_token_state(self, slots, tokens, next_pos, state: SlotState) -> None:
        # Padding rows all point at the dummy slot: force its state back to (token 0, position 0).
        if self.options.kernels.sampler and tokens.device.type == "cpu":
            # One op call: inductor's code for the two index_copy_ was a kernel of its own in every graph.
            torch.ops.vllm_neuron.store_token_state_(state.last_token, state.position, slots, tokens, next_pos)
            return
        dummy = slots == state.last_token.shape[0] - 1
        state.last_token.index_copy_(0, slots, torch.where(dummy, torch.zeros_like(tokens), tokens))
        state.position.index_copy_(0, slots, torch.where(dummy, torch.zeros_like(next_pos), next_pos))

    @recorded
    def _prefill(self, x: PrefillInputs) -> tuple[StepOutput, torch.Tensor]:
        meta = self.prefill_meta(x)
        hidden, _ = self.forward(x.input_ids, x.positions, x.kv_caches, meta, self._group_metas(meta, x.groups, True),
                                 self._prefill_kwargs(x))
        logits = self.model.compute_logits(hidden[x.logits_indices])
        next_pos = x.positions[x.logits_indices] + 1  # where the sampled token will sit
        slots, state = x.sampling.slots, x.sampling.state
        tokens, logits = self._sample_rows(logits, x.bitmask, slots, next_pos, state)
        self._write_token_state(slots, tokens, next_pos, state)
        return StepOutput(tokens, logits), hidden

    def decode(self, x: SlotDecodeInputs) -> StepOutput:
        return self._decode(x)

    @recorded
    def _decode(self, x: SlotDecodeInputs) -> StepOutput:
        state, rows, bs = x.state, x.row_slots, self.options.block_size
        ids = state.last_token[rows]
        pos = state.position[rows]

        def tables(table) -> tuple[torch.Tensor, torch.Tensor]:  # (slot_mapping, [B, C // block_size] tables)
            return (table[rows, pos // bs] * bs + pos % bs, table[rows[:, None], x.context_cols[None, :]])

        slot_mapping, block_tables = tables(state.block_table)
        meta = self.decode_meta(slot_mapping, block_tables, pos)
        group_metas = tuple(dataclasses.replace(meta, slot_mapping=sm, block_tables=t)
                            for sm, t in map(tables, state.group_tables))
        extras: dict[str, Any] = {name: value[rows] for name, value in state.extras.items()}
        hidden, _ = self.forward(ids, pos, x.kv_caches, meta, group_metas, extras)
        tokens, logits = self._sample_rows(self.model.compute_logits(hidden), x.bitmask, rows, pos + 1, state)
        self._write_token_state(rows, tokens, pos + 1, state)
        return StepOutput(tokens, logits)
