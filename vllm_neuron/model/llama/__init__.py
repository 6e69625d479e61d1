from vllm_neuron.model.llama.model import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
