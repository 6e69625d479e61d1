from vllm_neuron.model.gemma3.model import Gemma3ForCausalLM

__all__ = ["Gemma3ForCausalLM"]
