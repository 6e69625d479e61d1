"""Structured outputs: constraint parameters, xgrammar compilation, per-request grammar matchers."""
from vllm_neuron.structured_output.params import StructuredOutputsParams, validate

__all__ = ["StructuredOutputsParams", "validate"]
