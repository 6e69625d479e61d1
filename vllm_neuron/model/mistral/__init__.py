from vllm_neuron.model.mistral.model import MistralForCausalLM

__all__ = ["MistralForCausalLM"]
