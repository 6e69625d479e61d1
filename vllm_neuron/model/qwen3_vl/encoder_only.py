"""Qwen3-VL's vision tower alone, for an EPD encoder instance (--mm-encoder-only): `model.visual.*` of the
checkpoint is loaded and every other tensor skipped, so no language-model weight takes memory."""
from __future__ import annotations

from torch import nn

from vllm_neuron.model.base import CausalLM, Target
from vllm_neuron.model.qwen3_vl.config import Qwen3VLArchConfig
from vllm_neuron.model.qwen3_vl.model import Qwen3VLForConditionalGeneration
from vllm_neuron.model.qwen3_vl.vision import Qwen3VLVisionModel
from vllm_neuron.model.qwen3_vl.vision_parallel import VisionParallel


class Qwen3VLVisionTower(CausalLM):
    language_model_only = False
    encoder_parallel = VisionParallel()  # one process: an encoder instance scales by more instances

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.mm_arch = Qwen3VLArchConfig.from_hf(hf_config)
        self.model = nn.Module()
        self.model.visual = Qwen3VLVisionModel(self.mm_arch.vision)

    @property
    def num_deepstack(self) -> int:
        return len(self.mm_arch.vision.deepstack_visual_indexes)

    encode = Qwen3VLForConditionalGeneration.encode

    def checkpoint_target(self, name: str) -> Target | None:
        if not name.startswith("model.visual."):
            return None
        return Qwen3VLForConditionalGeneration.checkpoint_target(self, name)
