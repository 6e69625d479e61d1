"""Checkpoints on local disk: HF directories (safetensors), GGUF files, the bundled model, tokenizers."""

from vllm_neuron.model.loader.bundled import bundled_model_path
from vllm_neuron.model.loader.checkpoint import Checkpoint, load_checkpoint, resolve_model_path
from vllm_neuron.model.loader.tokenizer import load_tokenizer

__all__ = [
    "Checkpoint",
    "bundled_model_path",
    "load_checkpoint",
    "load_tokenizer",
    "resolve_model_path",
]
