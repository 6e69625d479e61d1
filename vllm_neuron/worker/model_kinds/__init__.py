"""What is special about a kind of model, as state the runners call at fixed points (base.py says which);
multimodal.py: images and video (Qwen3-VL); audio.py: audio clips (Qwen3-ASR); LoRA adapters (worker/lora/state.py) are such a component too.
`make_model_kinds` picks a model's, once, when it is built."""
from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_neuron.worker.model_kinds.base import GraphSpec, ModelKindState
from vllm_neuron.worker.model_kinds.multimodal import MultimodalState


def make_model_kinds(config, hf_config, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                     graph: Callable[[str, int, int], Callable]) -> list[ModelKindState]:
    """The state of what is special about `model` (none for a plain text model). graph(kind, size, context):
    the runner's compiled graph of a bucket, for kinds that run graphs of their own."""
    kinds: list[ModelKindState] = []
    modalities = getattr(model, "modalities", ("image", "video"))
    if getattr(model, "multimodal", False) and "audio" in modalities:
        from vllm_neuron.worker.model_kinds.audio import AudioState

        kinds.append(AudioState(config, hf_config, model, dtype, device, graph))
    elif getattr(model, "multimodal", False):
        kinds.append(MultimodalState(config, hf_config, model, dtype, device, graph))
    lora = getattr(config, "lora", None)
    if lora is not None:
        from vllm_neuron.worker.lora.state import LoRAState

        kinds.append(LoRAState(lora, hf_config, model, dtype, device))
    return kinds


__all__ = ["GraphSpec", "ModelKindState", "make_model_kinds"]
