from vllm_neuron.model.gpt_oss.model import GptOssForCausalLM

__all__ = ["GptOssForCausalLM"]
