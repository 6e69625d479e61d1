"""What a pipeline stage's model holds (distributed/pipeline.py splits the layers): its own decoder layers, the
embedding on the first stage (and on the last when the LM head is tied to it), the LM head on the last.
Another stage's layer is an `AbsentLayer` (no parameters: nothing allocated), and its checkpoint tensors are
skipped at load (`stage_holds_tensor`), so parameter names stay the checkpoint's on every stage."""
from __future__ import annotations

from torch import nn

from vllm_neuron.distributed.pipeline import Stage


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
