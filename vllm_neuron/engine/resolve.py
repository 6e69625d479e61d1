"""Raw engine arguments -> the resolved EngineConfig, in the process that received them.

The model's facts come from its config (HF config.json or GGUF metadata: `load_checkpoint` reads no tensor
data) and its architecture's declared spec; config/engine_config.py's `resolve` does the rest. The engine
core processes, tensor-parallel ranks, compile workers and replicas get the result and never call this.
"""
from __future__ import annotations

from vllm_neuron.config import engine_config
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import EngineConfig, ModelFacts
from vllm_neuron.model.loader import Checkpoint, load_checkpoint
from vllm_neuron.model.registry import check_quantization, is_multimodal, resolve_model_class


def resolve_engine_config(args: EngineArgs, checkpoint: Checkpoint | None = None) -> tuple[EngineConfig, Checkpoint]:
    """(the resolved config, the checkpoint it was resolved for): every refusal happens here, before any
    engine process starts (an architecture we do not serve included)."""
    ckpt = checkpoint or load_checkpoint(args.model)
    cls = resolve_model_class(ckpt.hf_config)
    spec = cls.spec(ckpt.hf_config)
    facts = ModelFacts(max_model_len=ckpt.hf_config.get_text_config().max_position_embeddings,
                       moe=spec.is_moe, sliding_window=spec.has_sliding_window, multimodal=is_multimodal(ckpt.hf_config))
    config = engine_config.resolve(args, facts)
    # The architecture must honour the weight quantization asked for ('bf16' resolved to none).
    check_quantization(cls, spec, config.neuron_config.quantization)
    return config, ckpt
