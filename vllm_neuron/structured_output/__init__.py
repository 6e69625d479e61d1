"""Structured outputs: constraint parameters, xgrammar compilation, per-request grammar matchers."""
from vllm_neuron.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
