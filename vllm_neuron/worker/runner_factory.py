"""The model runner for a configuration: MRv2, MRv1, or MRv1's multimodal form (the engine and the
parallel compile workers build the same one)."""
from __future__ import annotations

from typing import Any

import torch

from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.model.registry import is_multimodal


def make_runner(config: EngineConfig, ckpt: Any, device: torch.device, dtype: torch.dtype, backend: str):
    if config.use_v2_model_runner:
        from vllm_neuron.worker.model_runner_v2 import ModelRunnerV2

        return ModelRunnerV2(config, ckpt, device, dtype, backend)
    if is_multimodal(ckpt.hf_config):
        from vllm_neuron.worker.model_runner_mm import MultimodalRunnerV1

        return MultimodalRunnerV1(config, ckpt, device, dtype, backend)
    from vllm_neuron.worker.model_runner_v1 import ModelRunnerV1

    return ModelRunnerV1(config, ckpt, device, dtype, backend)
