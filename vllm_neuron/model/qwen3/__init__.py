from vllm_neuron.model.qwen3.model import Qwen3ForCausalLM

__all__ = ["Qwen3ForCausalLM"]
