from vllm_neuron.model.qwen3_vl.model import Qwen3VLForConditionalGeneration

__all__ = ["Qwen3VLForConditionalGeneration"]
