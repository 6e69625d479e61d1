"""The points where a pipeline stage's graph talks to its neighbours, as torch custom ops (CPU, gloo p2p on
parallel_state.pipe_group), so a compiled bucket graph holds them like any other op.

A stage's graph is the whole step's graph (worker/graphs.py, unchanged) on a model that holds only its layers:
* `recv_hidden` replaces the token embedding on every stage but the first: [N, hidden] from the previous stage
  (one call per micro-batch, model/pipeline_stage.py);
* `send_hidden` ends every stage but the last after its layers (the graph's "hidden states" are then a
  placeholder of the same shape, never read for anything but its shape and order);
* the last stage computes the logits and `share_logits` sends them to every earlier stage of its column;
  there `recv_logits` stands in for the LM head. Every stage then samples the same tokens from the same rows,
  as tensor-parallel ranks do after their all-gather, so MRv2's in-graph token state, host sampling,
  logprobs and grammar masks need nothing of their own, and rank 0's result is the engine's.
The logits cross rather than the tokens for that reason: [rows, vocab] per step (a decode batch of 8 on a
49k vocabulary is 1.5 MB in fp32), small beside a stage's weights on the loopback or a LAN.

Order: each op's input is the previous one's output (recv -> layers -> send -> placeholder -> recv_logits;
micro-batch j + 1's recv or `order_after` takes micro-batch j's output), so neither the tracer nor inductor
can reorder or drop them; the peer runs the same graph, and every message carries its micro-batch's tag, so
the sends and receives pair up (a prompt-logprobs step calls compute_logits per slice on every stage alike).
"""
from __future__ import annotations

import torch

from vllm_neuron.distributed import parallel_state as ps

LOGITS_TAG = 1 << 20  # beside the micro-batches' tags (0, 1, ...)


def _dist():
    import torch.distributed as dist

    return dist


@torch.library.custom_op("vllm_neuron::pp_recv_hidden", mutates_args=())
def recv_hidden(positions: torch.Tensor, hidden_size: int, dtype: torch.dtype, micro_batch: int,
                after: torch.Tensor | None) -> torch.Tensor:
    """[N, hidden] of micro-batch `micro_batch` (N tokens: `positions` gives N) from the previous stage; `after`
    (unused) orders it after that tensor's op."""
    out = torch.empty(positions.shape[0], hidden_size, dtype=dtype)
    _dist().recv(out, src=ps.info().place().prev_rank, group=ps.pipe_group(), tag=micro_batch)
    return out


@recv_hidden.register_fake
def _(positions, hidden_size, dtype, micro_batch, after):
    return positions.new_empty((positions.shape[0], hidden_size), dtype=dtype)


@torch.library.custom_op("vllm_neuron::pp_send_hidden", mutates_args=())
def send_hidden(x: torch.Tensor, micro_batch: int) -> torch.Tensor:
    """Sends this stage's output of micro-batch `micro_batch` to the next stage; returns a placeholder of x's
    shape (see the module docstring). Each micro-batch has its tag, so the pairing never depends on the order."""
    _dist().send(x.contiguous(), dst=ps.info().place().next_rank, group=ps.pipe_group(), tag=micro_batch)
    return torch.empty_like(x)


@send_hidden.register_fake
def _(x, micro_batch):
    return torch.empty_like(x)


@torch.library.custom_op("vllm_neuron::pp_order_after", mutates_args=())
def order_after(x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """x (a copy), ordered after `after`'s op: the first stage starts micro-batch j + 1 once j is sent."""
    return x.clone()


@order_after.register_fake
def _(x, after):
    return torch.empty_like(x)


@torch.library.custom_op("vllm_neuron::pp_recv_logits", mutates_args=())
def recv_logits(hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The last stage's logits of the rows `hidden` stands for ([rows, vocab], hidden's dtype)."""
    out = torch.empty(hidden.shape[0], vocab_size, dtype=hidden.dtype)
    _dist().recv(out, src=ps.info().place().last_stage_rank, group=ps.pipe_group(), tag=LOGITS_TAG)
    return out


@recv_logits.register_fake
def _(hidden, vocab_size):
    return hidden.new_empty((hidden.shape[0], vocab_size))


@torch.library.custom_op("vllm_neuron::pp_share_logits", mutates_args=())
def share_logits(logits: torch.Tensor) -> torch.Tensor:
    """The last stage: sends its logits to every earlier stage of its column; returns them (a copy: a custom
    op's output may not alias its input)."""
    logits = logits.contiguous()
    place = ps.info().place()
    dist = _dist()
    works = [dist.isend(logits, dst=r, group=ps.pipe_group(), tag=LOGITS_TAG) for r in place.column[:-1]]
    for w in works:
        w.wait()
    return logits.clone()


@share_logits.register_fake
def _(logits):
    return torch.empty_like(logits)
