"""/v1/chat/completions: chat template -> token ids -> engine, streamed or not, in vLLM's shape."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_neuron.engine.protocol import AdmissionTicket, TokensPrompt
from vllm_neuron.entrypoints.openai.chat_harmony import HarmonyChat
from vllm_neuron.entrypoints.openai.chat_output import ChoiceDelta, ChoiceParser, TextChoiceParser, reasoning_fields
from vllm_neuron.entrypoints.openai.errors import BadRequestError, from_exception
from vllm_neuron.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    DeltaToolCall,
    ErrorResponse,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from vllm_neuron.entrypoints.openai.request_policy import check_unsupported_fields, parse_request
from vllm_neuron.entrypoints.openai.serving_engine import ChoiceAccumulator, OpenAIServing, RequestTracker
from vllm_neuron.entrypoints.openai.streaming import SSE_DONE, run_until_disconnect, sse
from vllm_neuron.entrypoints.openai.structured import structured_outputs_from_request
from vllm_neuron.entrypoints.openai.tool_calls import ToolChoice, resolve_tool_choice
from vllm_neuron.outputs import Logprob
from vllm_neuron.reasoning import ReasoningParser, ReasoningParserManager
from vllm_neuron.reasoning.base import HARMONY_PARSER
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.structured_output.params import StructuredOutputsParams
from vllm_neuron.tool_parsers import ToolParser, ToolParserManager

_ROLE = "assistant"


@dataclass
class _Ctx:
    req: ChatCompletionRequest
    model: str
    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    echo_text: str | None
    created: int
    arrival: float
    tool: ToolChoice
    mm_items: list | None = None  # processed media (EngineClient.process_multimodal)
    ticket: AdmissionTicket | None = None  # released when the request ends (RequestTracker.close)
    prefill: list[int] | None = None  # harmony: the answer's start the prompt ends with (a tool call's header)


def check_generation_prompt_flags(data: dict[str, Any]) -> None:
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise BadRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              param="continue_final_message")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # openai_gptoss: harmony renders and parses (chat_harmony.py); the others split text.
        self.harmony = HarmonyChat(self.tokenizer) if reasoning_parser == HARMONY_PARSER else None
        self.reasoning_parser: type[ReasoningParser] | None = \
            ReasoningParserManager.get(reasoning_parser) if reasoning_parser and self.harmony is None else None
        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (one of "
                             f"{', '.join(ToolParserManager.names())})")
        parser = ToolParserManager.get(tool_call_parser) if tool_call_parser else None
        # tool_choice="auto" is served only with both flags (as in vLLM).
        self.tool_parser: type[ToolParser] | None = parser if enable_auto_tool_choice else None

    async def create_chat_completion(self, data: dict[str, Any], raw_request: Request) -> Response:
        arrival = time.monotonic()
        check_unsupported_fields(data, set(ChatCompletionRequest.model_fields), chat=True)
        check_generation_prompt_flags(data)
        req = parse_request(ChatCompletionRequest, data)
        return await self.chat(req, raw_request, arrival)

    async def chat(self, req: ChatCompletionRequest, raw_request: Request, arrival: float,
                   http: bool = True) -> Any:
        """A parsed chat request served: an HTTP response, or (`http` False, for the Responses API) the
        ChatCompletionResponse, or for a stream the async iterator of its chunk objects (an ErrorResponse
        last when it fails)."""
        model = self.models.resolve(req.model)
        self.check_engine()
        if req.stream_options is not None and not req.stream:
            raise BadRequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if req.top_logprobs and not req.logprobs:
            raise BadRequestError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        self.check_logprobs_cap(req.top_logprobs, "top_logprobs")
        self.check_logprobs_cap(req.prompt_logprobs, "prompt_logprobs")
        self.limits.check_n(req.n)
        tool = resolve_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser,
                                   auto_served=self.harmony is not None)
        if self.harmony is not None:
            self.harmony.check_request(req)
            tool = self.harmony.tool_choice(tool)
        structured, structured_param = structured_outputs_from_request(req)
        if tool.structured_outputs is not None:
            if structured is not None:
                raise BadRequestError(f"tool_choice {tool.mode!r} constrains the output itself; it cannot be "
                                      f"combined with `{structured_param}`.", param=structured_param)
            structured, structured_param = tool.structured_outputs, "tools"
        # Room among the admitted requests before any work (rendering, tokenization, media, grammar).
        return await self.admitted(req.n or 1, lambda ticket: self._create(
            req, model, tool, structured, structured_param, arrival, ticket, raw_request, http))

    async def _create(self, req: ChatCompletionRequest, model: str, tool: ToolChoice,
                      structured: StructuredOutputsParams | None, structured_param: str | None, arrival: float,
                      ticket: AdmissionTicket, raw_request: Request, http: bool) -> Any:
        if self.harmony is not None:
            return await self._create_harmony(req, model, tool, structured, structured_param, arrival, ticket,
                                              raw_request, http)
        media: dict[str, list] | None = {} if self.engine.is_multimodal else None
        text = await self.render_chat(req.messages, request_template=req.chat_template,
                                      add_generation_prompt=req.add_generation_prompt,
                                      continue_final_message=req.continue_final_message,
                                      template_kwargs=self._template_kwargs(req), documents=req.documents,
                                      tools=req.tools, media=media)
        # The template writes the special tokens itself: no second BOS unless asked for.
        prompt_ids = await self.encode(text, req.add_special_tokens, bounded=req.truncate_prompt_tokens is None)
        mm_items = None
        if media:
            if req.truncate_prompt_tokens is not None:
                raise BadRequestError("truncate_prompt_tokens cannot be combined with media content parts.",
                                      param="truncate_prompt_tokens")
            try:  # fetching and decoding media blocks: off the event loop
                prompt_ids, mm_items = await self.run_blocking(self.engine.process_multimodal, prompt_ids, media,
                                                               req.mm_processor_kwargs)
            except ValueError as e:
                raise BadRequestError(str(e), param="messages") from None
        if req.truncate_prompt_tokens is not None:
            keep = self.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
            if keep < 1:
                raise BadRequestError("truncate_prompt_tokens must be -1 or at least 1.",
                                      param="truncate_prompt_tokens")
            prompt_ids = prompt_ids[:keep] if req.truncation_side == "right" else prompt_ids[-keep:]
        if req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = req.max_tokens, "max_tokens"
        max_tokens = self.resolve_max_tokens(len(prompt_ids), requested, param)
        if structured is not None:
            await self.check_structured_outputs(structured, structured_param, max_tokens)
            structured = self._after_reasoning(structured, text)
        sp = self.build_sampling_params(req, max_tokens=max_tokens,
                                        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                        structured_outputs=structured, prompt_logprobs=req.prompt_logprobs)
        if tool.mode == "auto":
            self.tool_parser(self.tokenizer).adjust_request(sp)
        return await self._start(req, model, tool, sp, prompt_ids, text, mm_items, arrival, ticket, raw_request,
                                 http)

    async def _create_harmony(self, req: ChatCompletionRequest, model: str, tool: ToolChoice,
                              structured: StructuredOutputsParams | None, structured_param: str | None,
                              arrival: float, ticket: AdmissionTicket, raw_request: Request, http: bool) -> Any:
        prompt_ids, prefill = await self.run_blocking(self.harmony.render, req, tool)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.resolve_max_tokens(len(prompt_ids), requested, "max_completion_tokens"
                                             if req.max_completion_tokens is not None else "max_tokens")
        if structured is not None:
            await self.check_structured_outputs(structured, structured_param, max_tokens)
            if tool.mode != "named":  # a named call's arguments start right after the prefill
                structured = dataclasses.replace(structured, _reasoning_end=self.harmony.reasoning_end)
        sp = self.build_sampling_params(req, max_tokens=max_tokens,
                                        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                        structured_outputs=structured, prompt_logprobs=req.prompt_logprobs)
        sp.stop_token_ids = sorted(set(sp.stop_token_ids or []) | set(self.harmony.stop_token_ids))
        sp.skip_special_tokens = False  # the answer's text is parsed from its tokens; keep it whole
        text = self.harmony.encoding.decode(prompt_ids)
        return await self._start(req, model, tool, sp, prompt_ids, text, None, arrival, ticket, raw_request, http,
                                 prefill)

    async def _start(self, req: ChatCompletionRequest, model: str, tool: ToolChoice, sp: SamplingParams,
                     prompt_ids: list[int], text: str, mm_items: list | None, arrival: float,
                     ticket: AdmissionTicket, raw_request: Request, http: bool,
                     prefill: list[int] | None = None) -> Any:
        echo_text = None
        if req.echo:
            last = req.messages[-1] if req.messages else {}
            if last.get("role") == _ROLE and isinstance(last.get("content"), str):
                echo_text = last["content"]
        request_id = f"chatcmpl-{self.base_request_id(raw_request, req.request_id)}"
        ctx = _Ctx(req, model, request_id, prompt_ids, text, echo_text, int(time.time()), arrival, tool, mm_items,
                   ticket, prefill)
        if req.stream:
            if not http:
                return self._stream(ctx, sp)
            return StreamingResponse(self._sse(self._stream(ctx, sp)), media_type="text/event-stream")
        if not http:
            return await self._full(ctx, sp)
        result = await run_until_disconnect(self._full(ctx, sp), raw_request)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(content=result.model_dump())

    def _after_reasoning(self, structured: StructuredOutputsParams, prompt_text: str) -> StructuredOutputsParams:
        """With a reasoning parser the constraint starts once the reasoning ends (vLLM's rule), unless the
        prompt closed the reasoning already (thinking off)."""
        if self.reasoning_parser is None:
            return structured
        parser = self.reasoning_parser(self.tokenizer)
        parser.start(prompt_text)
        end_id = parser.reasoning_end_token_id()
        if end_id is None or parser.reasoning_done:
            return structured
        return dataclasses.replace(structured, _reasoning_end=(end_id,))

    def choice_parser(self, ctx: _Ctx) -> ChoiceParser:
        if self.harmony is not None:
            return self.harmony.choice_parser(ctx.req, ctx.tool, ctx.prefill or [])
        reasoning = self.reasoning_parser(self.tokenizer) if self.reasoning_parser is not None else None
        return TextChoiceParser(ctx.prompt_text, reasoning, ctx.tool, self._parser(ctx))

    @staticmethod
    def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        return kwargs

    def _engine_prompt(self, ctx: _Ctx) -> TokensPrompt:
        if ctx.mm_items:
            return TokensPrompt(prompt_token_ids=ctx.prompt_ids, prompt=ctx.prompt_text,
                                multi_modal_items=ctx.mm_items)
        return TokensPrompt(prompt_token_ids=ctx.prompt_ids, prompt=ctx.prompt_text)

    def _logprobs(self, token_ids: list[int], steps: list[dict[int, Logprob]], num_top: int,
                  as_ids: bool) -> ChatCompletionLogProbs:
        content = []
        for k, tid in enumerate(token_ids):
            step = steps[k] if k < len(steps) else None
            lp = step.get(tid) if step is not None else None
            tok = self.token_str(tid, lp, as_ids)
            top = []
            for t, alt in self.top_entries(step, num_top) if step is not None else ():
                s = self.token_str(t, alt, as_ids)
                top.append(ChatCompletionLogProb(token=s, logprob=self.clamp(alt.logprob),
                                                 bytes=list(s.encode("utf-8", errors="replace"))))
            # Every field passed explicitly: streamed chunks are dumped with exclude_unset.
            content.append(ChatCompletionLogProbsContent(
                token=tok, logprob=self.clamp(lp.logprob) if lp is not None else -9999.0,
                bytes=list(tok.encode("utf-8", errors="replace")), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    async def _full(self, ctx: _Ctx, sp: SamplingParams) -> ChatCompletionResponse:
        req = ctx.req
        tracker = RequestTracker(self, ctx.arrival, ctx.ticket)
        choices = {j: ChoiceAccumulator() for j in range(sp.n)}
        prompt_logprobs = None
        error: BaseException | None = None
        kv_transfer_params = None
        try:
            async for res in self.generate(tracker, self._engine_prompt(ctx), sp, ctx.request_id,
                                           len(ctx.prompt_ids), ctx.req.priority, self.models.lora_request(ctx.model)):
                kv_transfer_params = res.kv_transfer_params or kv_transfer_params
                prompt_logprobs = res.prompt_logprobs or prompt_logprobs
                for o in res.outputs:
                    choices[o.index].add(o)
        except Exception as e:
            error = e
            raise
        finally:
            tracker.close(error)
        as_ids = bool(req.return_tokens_as_token_ids)
        out, completion_tokens = [], 0
        for j, c in sorted(choices.items()):
            completion_tokens += len(c.token_ids)
            logprobs = None
            if req.logprobs:
                logprobs = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0, as_ids)
            finish_reason = c.finish_reason
            found = self.choice_parser(ctx).final("".join(c.text), c.token_ids)
            reasoning = found.reasoning if req.include_reasoning else None
            content = found.content
            if ctx.echo_text:
                content = ctx.echo_text + (content or "")
            calls = [ToolCall(id=tc.id, function=FunctionCall(name=tc.function.name, arguments=tc.function.arguments))
                     for tc in found.tool_calls]
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            message = ChatMessage(role=_ROLE, content=content, tool_calls=calls, **reasoning_fields(reasoning))
            out.append(ChatCompletionResponseChoice(
                index=j, message=message, logprobs=logprobs,
                finish_reason=finish_reason, stop_reason=c.stop_reason,
                token_ids=c.token_ids if req.return_token_ids else None))
        prompt_tokens = len(ctx.prompt_ids)
        return ChatCompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=out,
            usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens),
            prompt_token_ids=ctx.prompt_ids if req.return_token_ids else None, kv_transfer_params=kv_transfer_params,
            prompt_logprobs=self.prompt_logprobs_json(prompt_logprobs))

    def _parser(self, ctx: _Ctx) -> ToolParser | None:
        return self.tool_parser(self.tokenizer) if ctx.tool.mode == "auto" and self.tool_parser else None

    def _chunk(self, ctx: _Ctx, choices: list[ChatCompletionResponseStreamChoice],
               usage: UsageInfo | None = None) -> ChatCompletionStreamResponse:
        chunk = ChatCompletionStreamResponse(id=ctx.request_id, object="chat.completion.chunk",
                                             created=ctx.created, model=ctx.model, choices=choices)
        if usage is not None:
            chunk.usage = usage
        return chunk

    @staticmethod
    async def _sse(stream: AsyncIterator[ChatCompletionStreamResponse | ErrorResponse]) -> AsyncIterator[str]:
        async for item in stream:
            # Chunks carry only the fields that were set (vLLM's shape); an error object whole.
            yield sse(item) if isinstance(item, ErrorResponse) else sse(item, exclude_unset=True)
        yield SSE_DONE

    async def _stream(self, ctx: _Ctx, sp: SamplingParams) -> AsyncIterator[ChatCompletionStreamResponse |
                                                                            ErrorResponse]:
        req = ctx.req
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        as_ids = bool(req.return_tokens_as_token_ids)
        prompt_tokens = len(ctx.prompt_ids)
        tokens = [0] * sp.n

        def usage(j: int | None = None) -> UsageInfo:
            done = sum(tokens) if j is None else tokens[j]
            return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=done, total_tokens=prompt_tokens + done)

        parsers = [self.choice_parser(ctx) for _ in range(sp.n)]
        tracker = RequestTracker(self, ctx.arrival, ctx.ticket)
        error: Exception | None = None
        try:
            for j in range(sp.n):
                yield self._chunk(ctx, [ChatCompletionResponseStreamChoice(
                    index=j, delta=DeltaMessage(role=_ROLE, content=""), logprobs=None, finish_reason=None)],
                    usage(j) if continuous else None)
                if ctx.echo_text:
                    yield self._chunk(ctx, [ChatCompletionResponseStreamChoice(
                        index=j, delta=DeltaMessage(content=ctx.echo_text), logprobs=None, finish_reason=None)],
                        usage(j) if continuous else None)
            finished: set[int] = set()
            async for res in self.generate(tracker, self._engine_prompt(ctx), sp, ctx.request_id, prompt_tokens,
                                           ctx.req.priority, self.models.lora_request(ctx.model)):
                for o in res.outputs:
                    ids = list(o.token_ids)
                    if o.index in finished or (not o.text and not ids and o.finish_reason is None):
                        continue
                    if o.finish_reason is not None:
                        finished.add(o.index)
                    tokens[o.index] += len(ids)
                    logprobs = self._logprobs(ids, list(o.logprobs or []), req.top_logprobs or 0, as_ids) \
                        if req.logprobs else None
                    delta, finish_reason = self._delta(parsers[o.index], o.text, ids, o.finish_reason,
                                                       req.include_reasoning)
                    if delta is None and logprobs is None:
                        continue  # text held back by a parser
                    delta = delta or DeltaMessage()
                    choice = ChatCompletionResponseStreamChoice(
                        index=o.index, delta=delta, logprobs=logprobs,
                        finish_reason=finish_reason, stop_reason=o.stop_reason)
                    if req.return_token_ids:
                        choice.token_ids = ids
                    yield self._chunk(ctx, [choice], usage(o.index) if continuous else None)
            if include_usage:
                yield self._chunk(ctx, [], usage())
        except Exception as e:
            error = e
        finally:
            tracker.close(error)
        if error is not None:
            yield from_exception(error)

    @staticmethod
    def _delta(parser: ChoiceParser, text: str, token_ids: list[int], finish_reason: str | None,
               include_reasoning: bool) -> tuple[DeltaMessage | None, str | None]:
        """One choice's delta: reasoning, content and/or tool_calls deltas (None when there is nothing to
        send yet); "tool_calls" replaces "stop" once calls were made."""
        parts: ChoiceDelta = parser.feed(text, token_ids)
        if finish_reason is not None:
            parts = parts + parser.finish()
            if finish_reason == "stop" and parser.tools_called:
                finish_reason = "tool_calls"
        if not include_reasoning:
            parts.reasoning = ""
        if not parts and finish_reason is None:
            return None, None
        delta = DeltaMessage()
        if parts.reasoning:
            delta.reasoning_content = delta.reasoning = parts.reasoning
        if parts.content:
            delta.content = parts.content
        if parts.tool_calls:
            delta.tool_calls = [DeltaToolCall.model_validate(tc.to_dict()) for tc in parts.tool_calls]
        return delta, finish_reason
