from vllm_neuron.model.granite.model import GraniteForCausalLM

__all__ = ["GraniteForCausalLM"]
