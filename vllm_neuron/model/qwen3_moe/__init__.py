from vllm_neuron.model.qwen3_moe.model import Qwen3MoeForCausalLM

__all__ = ["Qwen3MoeForCausalLM"]
