"""The model runner an engine's config selects: Model Runner V2 or V1. What is special about the model
(multimodal media) or the step (a speculator) is a component the runner builds itself, not another class."""
from __future__ import annotations

import torch

from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.model.loader import Checkpoint
from vllm_neuron.worker.model_runner_v1 import ModelRunnerV1
from vllm_neuron.worker.model_runner_v2 import ModelRunnerV2
from vllm_neuron.worker.runner_base import ModelRunnerBase


def create_runner(config: EngineConfig, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype,
                  backend: str) -> ModelRunnerBase:
    cls = ModelRunnerV2 if config.use_v2_model_runner else ModelRunnerV1
    return cls(config, ckpt, device, dtype, backend)
