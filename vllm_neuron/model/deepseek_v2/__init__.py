from vllm_neuron.model.deepseek_v2.model import DeepseekV2ForCausalLM

__all__ = ["DeepseekV2ForCausalLM"]
