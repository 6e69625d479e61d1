"""Reasoning parsers (`--reasoning-parser NAME`): a model's thinking split from its answer."""
from vllm_neuron.reasoning import think  # noqa: F401 - registers the parsers
from vllm_neuron.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningParserManager

__all__ = ["ReasoningDelta", "ReasoningParser", "ReasoningParserManager"]
