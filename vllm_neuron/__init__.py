"""vllm-neuron: vLLM Neuron's design (static shapes, one compiled graph per bucket, paged KV) on any
PyTorch device."""
from vllm_neuron.version import __version__

_OUTPUTS = ("RequestOutput", "CompletionOutput", "PoolingRequestOutput", "EmbeddingRequestOutput",
            "ClassificationRequestOutput", "ScoringRequestOutput")
__all__ = ["LLM", "SamplingParams", "PoolingParams", *_OUTPUTS, "__version__"]


def __getattr__(name: str):
    # Lazy: `import vllm_neuron.envs` must not pull torch and transformers in.
    if name == "LLM":
        from vllm_neuron.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from vllm_neuron.sampling_params import SamplingParams

        return SamplingParams
    if name == "PoolingParams":
        from vllm_neuron.pooling_params import PoolingParams

        return PoolingParams
    if name in _OUTPUTS:
        from vllm_neuron import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
