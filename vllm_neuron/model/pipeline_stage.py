"""What a pipeline stage's model holds and how it runs its part of a step (distributed/pipeline.py splits the
layers).

Holding: its own decoder layers, the embedding on the first stage (and on the last when the LM head is tied to
it), the LM head on the last. Another stage's layer is an `AbsentLayer` (no parameters: nothing allocated), and
its checkpoint tensors are skipped at load (`stage_holds_tensor`), so parameter names stay the checkpoint's.

Running (`stage_forward`): a decode step's rows go through the stages in micro-batches (`micro_batches` of
them, contiguous rows), each handed on as soon as this stage is done with it, so stage s works on micro-batch
j + 1 while stage s + 1 works on micro-batch j. What overlaps and what does not:
* decode: the stages' layers over different micro-batches, and the hand-offs with the next micro-batch's layers.
  Each micro-batch reads the stage's weights again, so on a CPU whose decode step is bound by the weight stream
  the overlap must win more than the extra reads cost (benchmarks/pp_step_times.py measures both). On a 2-core
  host it did not (decode steps 1.5-2x longer in two micro-batches), hence VLLM_NEURON_PP_MICRO_BATCHES=1 by
  default;
* prefill: one piece (a prefill token attends to earlier tokens of its own step, which a later micro-batch would
  have to read back from the KV cache): stages run one after another;
* the logits: the last stage computes them once for every row, after its last micro-batch, and the earlier
  stages wait for them (model/layers/pipeline_ops.py), so consecutive steps do not overlap.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from vllm_neuron.distributed.pipeline import Stage, micro_batch_rows
from vllm_neuron.model.layers.attention import AttentionMetadata
from vllm_neuron.model.layers.pipeline_ops import order_after, recv_hidden, send_hidden


class AbsentLayer(nn.Module):
    """A decoder layer another pipeline stage holds (never called here)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a decoder layer of another pipeline stage was called")


def holds_embedding(stage: Stage, tied: bool) -> bool:
    return stage.is_first or (stage.is_last and tied)


def stage_holds_tensor(stage: Stage, name: str, tied: bool) -> bool:
    """Whether checkpoint tensor `name` (transformers' names) lands on this stage."""
    if stage.pp_size == 1:
        return True
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return stage.holds(int(parts[i + 1]))
    if "embed_tokens" in parts:
        return holds_embedding(stage, tied)
    if parts[0] == "lm_head":
        return stage.is_last
    return True  # the final norm (a few KiB) is kept everywhere


def decode_rows_meta(meta: AttentionMetadata, start: int, stop: int) -> AttentionMetadata:
    """A decode step's metadata for rows [start, stop) (one row per sequence)."""
    def rows(t):
        return None if t is None else t[start:stop]

    qs = meta.query_start
    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping[start:stop], mask=rows(meta.mask),
                               block_tables=rows(meta.block_tables), positions=rows(meta.positions),
                               query_start=None if qs is None else qs[start:stop + 1] - qs[start])


def stage_forward(stage: Stage, run_layers: Callable, embed: Callable[[], torch.Tensor], positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, meta, hidden_size: int, dtype: torch.dtype,
                  micro_batches: int) -> torch.Tensor:
    """This stage's part of a step (pp_size > 1): the input (embed() on the first stage, the previous stage's
    output elsewhere), run_layers(x, cos, sin, meta) over it, one micro-batch at a time on decode steps; returns
    the last layer's output on the last stage, send_hidden's placeholders elsewhere ([N, hidden] either way)."""
    n = positions.shape[0]
    single = not isinstance(meta, AttentionMetadata) or not meta.is_decode or meta.paged_decode
    pieces = [(0, n)] if single else micro_batch_rows(n, micro_batches)
    whole = len(pieces) == 1
    x_all = embed() if stage.is_first else None
    outs, prev = [], None
    for j, (a, b) in enumerate(pieces):
        m, c, s = (meta, cos, sin) if whole else (decode_rows_meta(meta, a, b), cos[a:b], sin[a:b])
        if stage.is_first:
            x = x_all if whole else x_all[a:b]
            # Micro-batch j + 1 starts after j has been handed on (so the next stage is never left waiting).
            x = x if prev is None else order_after(x, prev)
        else:
            x = recv_hidden(positions[a:b], hidden_size, dtype, j, prev)
        x = run_layers(x, c, s, m)
        prev = x if stage.is_last else send_hidden(x, j)
        outs.append(prev)
    return outs[0] if whole else torch.cat(outs)
