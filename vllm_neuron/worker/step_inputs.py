"""What a bucket graph takes and returns: one named dataclass per step kind, passed whole.

Every dataclass here is a pytree (registered below), so torch.compile flattens it into the graph's tensor
inputs, the compile cache's input signature names every field, and CUDA graph replay fills each leaf in
place. Fields that a configuration does not use are None (a constant of the traced graph: each bucket is
traced with one fixed structure); which attention fields are set follows the attention path:

* kernel attention (the CPU kernels): `seq_tables` and `query_start`, the context read through them;
* torch attention: `context_slots` / `context_seq` for a prefill that reads cached context, block tables
  for decode and verification.

A model kind adds named model inputs (`model_kwargs` for prefill, per-row `row_extras` for decode and
verification, per-slot `extras` in Model Runner V2's state), which the graphs hand to the model's forward
as keyword arguments; a speculator adds its own prefill inputs (`draft`) and KV layers (`draft_kv`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

KVCaches = list  # [(K, V)] per layer, each [slots, kv_heads, head_dim]


def _pytree(cls):
    pytree.register_dataclass(cls)
    return cls


@_pytree
@dataclass
class RowSampling:
    """MRv1's per-row in-graph sampling parameters ([rows] each; padded rows greedy)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniform: torch.Tensor  # counter_uniform(seed, position) of the token each row samples


@_pytree
@dataclass
class SlotState:
    """MRv2's device-resident per-request state, indexed by batch slot (worker/batch_state.py). The graphs
    read it and write each sampled row's token and position back in place."""

    last_token: torch.Tensor  # [slots]
    position: torch.Tensor  # [slots] position of last_token, i.e. of the token fed next
    block_table: torch.Tensor  # [slots, max_blocks]
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    group_tables: tuple = ()  # KV cache groups 1..: their block tables, like block_table
    extras: dict = field(default_factory=dict)  # a model kind's per-slot inputs, e.g. {"rope_delta": [slots]}


@_pytree
@dataclass
class SlotRows:
    """MRv2's prefill sampling: each sampled row's slot (padding rows: the dummy slot) and the state."""

    slots: torch.Tensor  # [rows]
    state: SlotState


@_pytree
@dataclass
class GroupTables:
    """KV cache group g >= 1: where the step's tokens go and the tables its layers read through (block
    tables, or context slots for a torch prefill)."""

    slot_mapping: torch.Tensor
    tables: torch.Tensor | None


@_pytree
@dataclass
class PrefillInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    query_seq: torch.Tensor  # [T] chunk index of each token, -1 for padding
    logits_indices: torch.Tensor  # [R] row r = last token of chunk r
    kv_caches: KVCaches
    sampling: RowSampling | SlotRows
    bitmask: torch.Tensor | None = None  # [R, words] int32 grammar masks (None: eager with no grammar row)
    seq_tables: torch.Tensor | None = None  # kernel attention: [R, max_blocks] chunk r's block table
    query_start: torch.Tensor | None = None  # kernel attention: [R + 1] chunk r owns rows [r], [r + 1]
    context_slots: torch.Tensor | None = None  # torch attention with cached context: [C]
    context_seq: torch.Tensor | None = None  # [C] chunk index of each context slot, -2 for padding
    groups: tuple = ()  # GroupTables of KV cache groups 1..
    model_kwargs: dict = field(default_factory=dict)  # a model kind's inputs, e.g. {"mm": ...}
    draft: Any = None  # a speculator's prefill inputs
    draft_kv: KVCaches = field(default_factory=list)  # a speculator's KV layers
    # --enable-prompt-embeds: [T, hidden] rows that replace the token embeddings where embeds_rows [T] is set
    embeds: torch.Tensor | None = None
    embeds_rows: torch.Tensor | None = None


@_pytree
@dataclass
class DecodeInputs:
    """MRv1's decode step: one row per sequence, host-built."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, C // block_size]
    kv_caches: KVCaches
    sampling: RowSampling
    bitmask: torch.Tensor | None = None
    groups: tuple = ()
    row_extras: dict = field(default_factory=dict)  # a model kind's per-row inputs, e.g. {"rope_delta": [B]}
    draft_kv: KVCaches = field(default_factory=list)


@_pytree
@dataclass
class SlotDecodeInputs:
    """MRv2's decode step: the rows' slots; everything else comes from the slot state."""

    row_slots: torch.Tensor  # [B]
    context_cols: torch.Tensor  # [C // block_size]: 0..n-1, the block-table columns the bucket reads
    state: SlotState
    kv_caches: KVCaches
    bitmask: torch.Tensor | None = None


@_pytree
@dataclass
class VerifyInputs:
    """A decode step with drafts (MRv1): 1 + K rows per sequence, the drafts to verify and the rejection
    sampler's uniforms."""

    input_ids: torch.Tensor  # [B * (1 + K)]
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [B, C // block_size]
    draft_ids: torch.Tensor  # [B, K]
    num_drafts: torch.Tensor  # [B]
    kv_caches: KVCaches
    sampling: RowSampling  # per sequence (its uniform unused)
    uniform_accept: torch.Tensor  # [B, K]
    uniform_sample: torch.Tensor  # [B, K + 1]
    bitmask: torch.Tensor | None = None  # [B * (1 + K), words]
    groups: tuple = ()
    row_extras: dict = field(default_factory=dict)  # per verified row
    draft_kv: KVCaches = field(default_factory=list)


@_pytree
@dataclass
class EncoderInputs:
    """One encoder bucket of block-packed media (model/qwen3_vl/preprocessing.py's VisionInputs)."""

    pixels: torch.Tensor  # [P, patch_dim]
    interp_idx: torch.Tensor  # [P, 4]
    interp_w: torch.Tensor  # [P, 4]
    rot_pos: torch.Tensor  # [P, 2]
    segment: torch.Tensor  # [blocks, block_size]


@_pytree
@dataclass
class AudioEncoderInputs:
    """One audio encoder bucket: mel chunks laid out one attention window per block (model/qwen3_asr/features.py)."""

    mel: torch.Tensor  # [blocks * chunks_per_window, mel bins, chunk frames]
    chunk_len: torch.Tensor  # [blocks * chunks_per_window] valid frames per chunk


@dataclass
class PromptRows:
    """The prompt positions of a prefill step whose logprobs its requests asked for (`prompt_logprobs`).
    Not a compiled graph's input: a step with such rows runs the bucket's graph function eagerly
    (worker/graphs.py `prefill_with_prompt_logprobs`), so every other step keeps its compiled graph as is."""

    rows: torch.Tensor  # [P] indices into the step's tokens
    targets: torch.Tensor  # [P] the prompt token each row predicts (the next position's)
    top_n: int  # top logprobs per row, the most any of the step's requests asked for


@dataclass
class PromptLogprobsOut:
    """Per PromptRows row: the target token's log-probability and rank (1 = the most likely), and the top_n."""

    logprobs: torch.Tensor  # [P] float32
    ranks: torch.Tensor  # [P]
    top_ids: torch.Tensor | None  # [P, top_n]
    top_logprobs: torch.Tensor | None


@_pytree
@dataclass
class StepOutput:
    """What a step graph returns: sampled tokens ([rows], or [B, 1 + K] for a verification), the logits of
    the sampled rows (the first verified row's for a verification), and the speculator's outputs."""

    tokens: torch.Tensor | None
    logits: torch.Tensor
    drafts: torch.Tensor | None = None  # [rows, K'] the next step's drafts (a draft model's)
    num_emitted: torch.Tensor | None = None  # [B] verification: accepted drafts + 1
    # neuron_config.tensor_capture: the tapped modules' tensors of every row, by name (worker/module_taps.py).
    captured: dict[str, torch.Tensor] | None = None
