"""EAGLE3 draft head (vLLM's `LlamaForCausalLMEagle3` checkpoint layout) for speculative decoding."""
from vllm_neuron.model.eagle3.config import Eagle3Config, read_eagle3_config
from vllm_neuron.model.eagle3.model import Eagle3DraftModel, load_eagle3_draft

__all__ = ["Eagle3Config", "Eagle3DraftModel", "load_eagle3_draft", "read_eagle3_config"]
