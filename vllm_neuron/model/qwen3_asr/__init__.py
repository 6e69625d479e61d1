from vllm_neuron.model.qwen3_asr.model import Qwen3ASRForConditionalGeneration

__all__ = ["Qwen3ASRForConditionalGeneration"]
