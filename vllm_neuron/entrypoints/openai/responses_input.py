"""/v1/responses requests: the request model, and the request (with the stored conversation it continues)
-> the chat request that serves it. Everything the server cannot honour is a 400 naming it: built-in tools
(web search, file search, ...), background mode, server-side conversations, prompt templates.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field

from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.openai.protocol import OpenAIRequestModel
from vllm_neuron.sampling_params import MAX_TEMPERATURE, SEED_MAX, SEED_MIN

BUILT_IN_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                  "code_interpreter", "computer_use_preview", "computer_use", "image_generation", "mcp",
                  "local_shell", "shell", "apply_patch", "custom")
# vLLM's sampling extras a Responses request may carry; they go to the chat request as they are.
_CHAT_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "priority", "stop",
                "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos", "min_tokens")


class ResponsesRequest(OpenAIRequestModel):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Union[str, dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = "disabled"
    include: list[str] | None = None
    background: bool = False
    # vLLM's extras
    request_id: str | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0


def check_unsupported(data: dict[str, Any]) -> None:
    for key in ("conversation", "prompt"):
        if data.get(key) is not None:
            raise BadRequestError(f"`{key}` is not supported by this server (no server-side conversations or prompt "
                                  "templates): send the input itself, or previous_response_id.", param=key)
    if data.get("background"):
        raise BadRequestError("background mode is not supported by this server.", param="background")
    include = data.get("include") or []
    if not isinstance(include, list):
        raise BadRequestError("include must be a list of strings.", param="include")
    unsupported = [v for v in include if v != "reasoning.encrypted_content"]
    if unsupported:
        # reasoning.encrypted_content is harmless: reasoning items carry their text in `content` instead.
        raise BadRequestError(f"include {unsupported} is not supported by this server; reasoning items carry their "
                              "text in `content`.", param="include")
    if data.get("top_logprobs"):
        raise BadRequestError("`top_logprobs` is not supported on /v1/responses by this server yet.",
                              param="top_logprobs")


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) -> chat tools; built-in tools are refused by name."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in BUILT_IN_TOOLS or (isinstance(kind, str) and kind.startswith("web_search")):
            raise BadRequestError(f"tools[{i}]: built-in tool {kind!r} is not supported by this server; only "
                                  '{"type": "function"} tools are.', param=f"tools[{i}].type")
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise BadRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"name\": ..., \"parameters\": "
                                  "{...}}.", param=f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise BadRequestError(f"tool_choice {kind!r} is not supported: use \"auto\", \"none\", \"required\" or "
                          '{"type": "function", "name": ...}.', param="tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise BadRequestError("text.format must be an object with a `type`.", param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise BadRequestError("text.format of type json_schema needs `schema`, a JSON schema object.",
                                  param="text.format.schema")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise BadRequestError(f"text.format type {fmt.get('type')!r} is not supported; valid types: text, "
                          "json_object, json_schema.", param="text.format.type")


def _text_of(content: Any, where: str) -> Any:
    """A message's content: text, or parts (input_text / output_text / input_image) in chat's form."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequestError(f"{where}.content must be a string or a list of content parts.",
                              param=f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise BadRequestError(f"{where}.content[{j}]: content part type {kind!r} is not supported; supported: "
                                  "input_text, output_text, input_image (image_url).", param=f"{where}.content[{j}]")
    return parts


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input (text or items) -> chat messages. Consecutive function calls become one assistant
    message with tool_calls; a reasoning item rides on the assistant message that follows it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequestError(f"{where}.role must be user, system, developer or assistant.",
                                      param=f"{where}.role")
            msg: dict[str, Any] = {"role": role, "content": _text_of(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not isinstance(call["id"], str) or not isinstance(call["function"]["name"], str):
                raise BadRequestError(f"{where}: a function_call item needs `call_id` and `name`.", param=where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise BadRequestError(f"{where}: a function_call_output item needs `call_id` and `output` (text).",
                                      param=where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or []
            texts = [c.get("text") for c in parts if isinstance(c, dict)] if isinstance(parts, list) else [None]
            if not all(isinstance(t, str) for t in texts):
                raise BadRequestError(f"{where}.content must be a list of {{\"type\": \"reasoning_text\", \"text\": "
                                      "...}} parts.", param=f"{where}.content")
            reasoning = "".join(texts)
        else:
            raise BadRequestError(f"{where}: input item type {kind!r} is not supported; supported: message, "
                                  "function_call, function_call_output, reasoning.", param=f"{where}.type")
    return out


def chat_request(req: ResponsesRequest, data: dict[str, Any], history: list[dict[str, Any]],
                 messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request body that serves `req` after `history` (the stored conversation it continues)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat: dict[str, Any] = {"messages": system + history + messages, "stream": req.stream}
    if req.model is not None:
        chat["model"] = req.model
    tools = chat_tools(req.tools)
    if tools:
        chat["tools"], chat["tool_choice"] = tools, chat_tool_choice(req.tool_choice)
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    elif req.tool_choice not in ("auto", "none"):
        raise BadRequestError("tool_choice needs `tools`.", param="tool_choice")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise BadRequestError("reasoning.effort must be a string (low, medium or high).", param="reasoning.effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = response_format(req.text)
    if fmt is not None:
        chat["response_format"] = fmt
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p", "user", "request_id", *_CHAT_EXTRAS):
        value = data.get(name)
        if value is not None:
            chat[name] = value
    return chat
