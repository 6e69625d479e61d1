"""Tool-call parsers for tool_choice="auto", one per model family, registered by name
(`--tool-call-parser NAME`)."""
from vllm_neuron.tool_parsers import hermes, llama3_json  # noqa: F401 - registers the parsers
from vllm_neuron.tool_parsers.base import (
    DeltaFunctionCall,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    JsonCallScanner,
    StreamDelta,
    ToolCall,
    ToolParser,
    ToolParserManager,
)

__all__ = ["DeltaFunctionCall", "DeltaToolCall", "ExtractedToolCalls", "FunctionCall", "JsonCallScanner",
           "StreamDelta", "ToolCall", "ToolParser", "ToolParserManager"]
