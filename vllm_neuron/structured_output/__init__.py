"""Structured outputs: constraint parameters, xgrammar compilation, per-request grammar matchers."""
from vllm_neuron.structured_output.params import StructuredOutputsParams

# Why a request's grammar failed in the engine (EngineCoreOutput.error_kind): the request's own fault, a
# grammar that failed or compiled past the time limit (a 400), or the compile threads' capacity (a 503).
GRAMMAR_INVALID = "invalid"
GRAMMAR_BUSY = "busy"

__all__ = ["GRAMMAR_BUSY", "GRAMMAR_INVALID", "StructuredOutputsParams"]
