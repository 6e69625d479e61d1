"""/v1/responses (OpenAI's Responses API, as vLLM serves it) for any chat model: the request becomes a chat
request (responses_input.py) served by the chat path (templates or harmony, reasoning parser, tools,
structured outputs), whose answer becomes output items - reasoning, message, function calls - whole or as
the Responses stream events. Stored responses (responses_store.py) back `previous_response_id` and
`GET /v1/responses/{id}`.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_neuron.entrypoints.openai.errors import NotFoundError
from vllm_neuron.entrypoints.openai.protocol import ChatCompletionRequest, ErrorResponse, random_uuid
from vllm_neuron.entrypoints.openai.request_policy import parse_request
from vllm_neuron.entrypoints.openai.responses_input import (ResponsesRequest, chat_request, check_unsupported,
                                                            input_messages)
from vllm_neuron.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from vllm_neuron.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm_neuron.entrypoints.openai.streaming import run_until_disconnect


@dataclass
class _Call:
    item_id: str
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class _Output:
    """One response's output as it accumulates (the ids are fixed up front: events and the final object
    name the same items)."""

    reasoning: str = ""
    content: str = ""
    calls: list[_Call] = field(default_factory=list)
    finish_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_id: str = field(default_factory=lambda: f"rs_{random_uuid()}")
    message_id: str = field(default_factory=lambda: f"msg_{random_uuid()}")
    has_reasoning: bool = False

    def items(self) -> list[dict[str, Any]]:
        out = []
        if self.has_reasoning or self.reasoning:
            out.append(reasoning_item(self.reasoning_id, self.reasoning))
        if self.content or not (self.calls or out):
            out.append(message_item(self.message_id, self.content))
        out += [call_item(c) for c in self.calls]
        return out


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: _Call, status: str = "completed") -> dict[str, Any]:
    return {"id": call.item_id, "type": "function_call", "call_id": call.call_id, "name": call.name,
            "arguments": call.arguments, "status": status}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
        return entry.response

    async def create_response(self, data: dict[str, Any], raw_request: Request) -> Response:
        arrival = time.monotonic()
        check_unsupported(data)
        req = parse_request(ResponsesRequest, data)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise NotFoundError(f"Previous response with id '{req.previous_response_id}' not found"
                                    + ("." if self.store.enabled else " (this server stores no responses: start "
                                       "it with --enable-store)."), param="previous_response_id")
            history = prev.conversation
        messages = input_messages(req.input)
        chat_req = parse_request(ChatCompletionRequest, chat_request(req, data, history, messages))
        model = self.chat.models.resolve(chat_req.model)
        head = {"id": f"resp_{random_uuid()}", "created_at": int(time.time()), "model": model}
        conversation = history + messages
        if req.stream:
            stream = await self.chat.chat(chat_req, raw_request, arrival, http=False)
            return StreamingResponse(self._closing(self._events(req, head, stream, conversation), stream),
                                     media_type="text/event-stream")
        result = await run_until_disconnect(self.chat.chat(chat_req, raw_request, arrival, http=False), raw_request)
        if result is None:
            return Response(status_code=499)
        out = _Output()
        choice = result.choices[0]
        msg = choice.message
        out.reasoning, out.has_reasoning = msg.reasoning_content or "", msg.reasoning_content is not None
        out.content = msg.content or ""
        out.calls = [_Call(f"fc_{random_uuid()}", tc.id, tc.function.name, tc.function.arguments)
                     for tc in msg.tool_calls]
        out.finish_reason = choice.finish_reason
        out.input_tokens, out.output_tokens = result.usage.prompt_tokens, result.usage.completion_tokens or 0
        return JSONResponse(self._finish(req, head, out, conversation))

    # ---- the response object ------------------------------------------------------------------------

    def _response(self, req: ResponsesRequest, head: dict[str, Any], status: str, output: list[dict[str, Any]],
                  out: _Output | None = None) -> dict[str, Any]:
        usage = None
        if out is not None:
            reasoning_tokens = len(self.chat.tokenizer.encode(out.reasoning, add_special_tokens=False)) \
                if out.reasoning else 0  # the answer's tokens re-encoded: the engine does not split them
            usage = {"input_tokens": out.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": out.output_tokens,
                     "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, out.output_tokens)},
                     "total_tokens": out.input_tokens + out.output_tokens}
        incomplete = status == "incomplete"
        return {**head, "object": "response", "status": status, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
                "store": req.store and self.store.enabled, "temperature": req.temperature,
                "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice,
                "tools": req.tools, "top_p": req.top_p, "truncation": "disabled", "user": req.user,
                "background": False, "usage": usage}

    def _finish(self, req: ResponsesRequest, head: dict[str, Any], out: _Output,
                conversation: list[dict[str, Any]]) -> dict[str, Any]:
        status = "incomplete" if out.finish_reason == "length" else "completed"
        response = self._response(req, head, status, out.items(), out)
        if req.store and self.store.enabled:
            turn: dict[str, Any] = {"role": "assistant", "content": out.content or None}
            if out.reasoning:
                turn["reasoning_content"] = out.reasoning
            if out.calls:
                turn["tool_calls"] = [{"id": c.call_id, "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments}} for c in out.calls]
            self.store.put(head["id"], StoredResponse(response, conversation + [turn]))
        return response

    # ---- streaming -------------------------------------------------------------------------------------

    @staticmethod
    async def _closing(events: AsyncIterator[str], stream: Any) -> AsyncIterator[str]:
        """The events; the chat stream under them closed when they end early (client gone): its engine request
        is aborted then, not when the generator is collected."""
        try:
            async for ev in events:
                yield ev
        finally:
            await stream.aclose()

    async def _events(self, req: ResponsesRequest, head: dict[str, Any], stream: AsyncIterator[Any],
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **body: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **body})}\n\n"

        out = _Output()
        items: list[dict[str, Any]] = []  # the output so far; the last one may be open
        open_kind: Any = None  # "reasoning" | "message" | call index

        def close() -> list[str]:
            nonlocal open_kind
            if open_kind is None:
                return []
            index, item = len(items) - 1, items[-1]
            evs = []
            if open_kind == "reasoning":
                item.update(reasoning_item(out.reasoning_id, out.reasoning))
                part = {"type": "reasoning_text", "text": out.reasoning}
                evs.append(event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=out.reasoning))
                evs.append(event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
            elif open_kind == "message":
                item.update(message_item(out.message_id, out.content))
                evs.append(event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=out.content, logprobs=[]))
                evs.append(event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=output_text(out.content)))
            else:
                call = out.calls[-1]
                item.update(call_item(call))
                evs.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=call.name, arguments=call.arguments))
            evs.append(event("response.output_item.done", output_index=index, item=item))
            open_kind = None
            return evs

        def open_item(kind: Any, item: dict[str, Any]) -> list[str]:
            nonlocal open_kind
            evs = close()
            items.append(item)
            index = len(items) - 1
            evs.append(event("response.output_item.added", output_index=index, item=item))
            if kind == "reasoning":
                evs.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part={"type": "reasoning_text", "text": ""}))
            elif kind == "message":
                evs.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=output_text("")))
            open_kind = kind
            return evs

        yield event("response.created", response=self._response(req, head, "in_progress", []))
        yield event("response.in_progress", response=self._response(req, head, "in_progress", []))
        async for chunk in stream:
            if isinstance(chunk, ErrorResponse):
                err = chunk.error
                yield event("error", code=str(err.code), message=err.message, param=err.param)
                yield event("response.failed", response={**self._response(req, head, "failed", items),
                                                         "error": {"code": str(err.code), "message": err.message}})
                return
            if chunk.usage is not None:
                out.input_tokens, out.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens or 0
            for choice in chunk.choices:
                d = choice.delta
                if d.reasoning_content:
                    if open_kind != "reasoning":
                        out.has_reasoning = True
                        for ev in open_item("reasoning", reasoning_item(out.reasoning_id, "", "in_progress")):
                            yield ev
                    out.reasoning += d.reasoning_content
                    yield event("response.reasoning_text.delta", item_id=out.reasoning_id, output_index=len(items) - 1,
                                content_index=0, delta=d.reasoning_content)
                if d.content:
                    if open_kind != "message":
                        for ev in open_item("message", message_item(out.message_id, "", "in_progress")):
                            yield ev
                    out.content += d.content
                    yield event("response.output_text.delta", item_id=out.message_id, output_index=len(items) - 1,
                                content_index=0, delta=d.content, logprobs=[])
                for tc in d.tool_calls:
                    if tc.id is not None:
                        call = _Call(f"fc_{random_uuid()}", tc.id, tc.function.name if tc.function else "")
                        out.calls.append(call)
                        for ev in open_item(("call", tc.index), call_item(call, "in_progress")):
                            yield ev
                    args = tc.function.arguments if tc.function else None
                    if args and out.calls:
                        out.calls[-1].arguments += args
                        yield event("response.function_call_arguments.delta", item_id=out.calls[-1].item_id,
                                    output_index=len(items) - 1, delta=args)
                if choice.finish_reason is not None:
                    out.finish_reason = choice.finish_reason
        for ev in close():
            yield ev
        response = self._finish(req, head, out, conversation)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield event(kind, response=response)
