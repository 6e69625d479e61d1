"""Chat completions in harmony for gpt-oss (`--reasoning-parser openai_gptoss`): the prompt rendered by
openai-harmony (not a chat template), the answer's channels parsed into reasoning, content and tool calls,
harmony's stop tokens, and tool_choice: "auto" (the tools offered in the developer message), "named" (the
answer starts as a call to that function, its arguments held to the parameters' schema), "required" (the
answer starts as a call to one of the functions), "none" (no tools offered).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from vllm_neuron.entrypoints.openai.chat_output import ChoiceDelta, ChoiceParser, ChoiceResult
from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.openai.tool_calls import ToolChoice
from vllm_neuron.harmony import render
from vllm_neuron.harmony.parse import HarmonyStream
from vllm_neuron.harmony.vocab import load_encoding
from vllm_neuron.tool_parsers import FunctionCall, ToolCall

FINAL_CHANNEL = "<|channel|>final<|message|>"


class HarmonyChat:
    def __init__(self, tokenizer: Any) -> None:
        self.encoding = load_encoding(tokenizer)  # a ValueError at start-up when no vocabulary is found
        # Harmony's token ids must be the model's: a tokenizer of another family would read garbage.
        probe = "<|start|>assistant<|channel|>final<|message|>"
        if list(tokenizer.encode(probe, add_special_tokens=False)) != self.encode(probe):
            raise ValueError("--reasoning-parser openai_gptoss renders harmony, whose tokens are gpt-oss's "
                             "(o200k_harmony): this model's tokenizer is not; use it with gpt-oss models only")
        self.stop_token_ids = list(self.encoding.stop_tokens_for_assistant_actions())
        self.reasoning_end = tuple(self.encode(FINAL_CHANNEL))

    def encode(self, text: str) -> list[int]:
        return list(self.encoding.encode(text, allowed_special="all"))

    @staticmethod
    def tool_choice(tool: ToolChoice) -> ToolChoice:
        # "required" is the prefilled call's, not the JSON-array grammar of the text models.
        return dataclasses.replace(tool, structured_outputs=None) if tool.mode == "required" else tool

    @staticmethod
    def check_request(req: Any) -> None:
        """The chat-template fields harmony has no use for are refused, not ignored."""
        for name in ("chat_template", "documents", "echo", "continue_final_message", "truncate_prompt_tokens"):
            if getattr(req, name):
                raise BadRequestError(f"`{name}` is not supported with harmony (gpt-oss, --reasoning-parser "
                                      "openai_gptoss): the prompt is rendered by openai-harmony, not a chat template.",
                                      param=name)
        kwargs = dict(req.chat_template_kwargs or {})
        effort = kwargs.pop("reasoning_effort", None)  # gpt-oss's own template takes it there too
        if kwargs:
            raise BadRequestError(f"chat_template_kwargs {sorted(kwargs)} have no meaning with harmony (gpt-oss); "
                                  "only reasoning_effort does.", param="chat_template_kwargs")
        if effort is not None and req.reasoning_effort is None:
            req.reasoning_effort = effort
        if not req.add_generation_prompt:
            raise BadRequestError("add_generation_prompt=false is not supported with harmony (gpt-oss): the prompt "
                                  "always ends where the assistant's answer starts.", param="add_generation_prompt")

    def render(self, req: Any, tool: ToolChoice) -> tuple[list[int], list[int]]:
        """(prompt token ids ending with the prefill, the prefill's ids) of a chat request."""
        from openai_harmony import Role

        tools = req.tools if tool.mode != "none" else None
        try:
            conv = render.conversation(req.messages, tools, req.reasoning_effort)
        except render.BadRequestError as e:
            raise BadRequestError(str(e), param=e.param) from None
        prefill = self.encode(render.prefill(tool.mode, tool.name))
        return list(self.encoding.render_conversation_for_completion(conv, Role.ASSISTANT)) + prefill, prefill

    def choice_parser(self, req: Any, tool: ToolChoice, prefill: list[int]) -> ChoiceParser:
        names = {(t.get("function") or {}).get("name") for t in req.tools or []} if tool.mode != "none" else set()
        return HarmonyChoiceParser(HarmonyStream(self.encoding, names, prefill))


class HarmonyChoiceParser(ChoiceParser):
    def __init__(self, stream: HarmonyStream) -> None:
        self.stream = stream

    def feed(self, text: str, token_ids: list[int]) -> ChoiceDelta:
        d = self.stream.feed(token_ids)
        return ChoiceDelta(d.reasoning, d.content, d.tool_calls)

    def finish(self) -> ChoiceDelta:
        d = self.stream.finish()
        return ChoiceDelta(d.reasoning, d.content, d.tool_calls)

    def final(self, text: str, token_ids: list[int]) -> ChoiceResult:
        whole = self.feed(text, token_ids) + self.finish()
        calls: list[ToolCall] = []
        for delta in whole.tool_calls:
            if delta.id is not None:
                calls.append(ToolCall(FunctionCall(delta.function.name, ""), id=delta.id))
            elif delta.function is not None and delta.function.arguments:
                calls[delta.index].function.arguments += delta.function.arguments
        content = whole.content if whole.content or not (calls or whole.reasoning) else None
        return ChoiceResult(whole.reasoning or None, content, calls)

    @property
    def tools_called(self) -> bool:
        return self.stream.calls > 0
