from vllm_neuron.model.phi3.model import Phi3ForCausalLM

__all__ = ["Phi3ForCausalLM"]
