from vllm_neuron.model.bert.model import BertEncoderModel

__all__ = ["BertEncoderModel"]
