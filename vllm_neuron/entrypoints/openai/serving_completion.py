"""/v1/completions: one or more prompts (text or token ids), streamed or not, in vLLM's shape."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_neuron.engine.protocol import AdmissionTicket, TokensPrompt
from vllm_neuron.entrypoints.openai.errors import BadRequestError, from_exception
from vllm_neuron.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from vllm_neuron.entrypoints.openai.request_policy import check_unsupported_fields, parse_request
from vllm_neuron.entrypoints.openai.serving_beam_search import (beam_search_completion, beam_search_params,
                                                                check_beam_search_request)
from vllm_neuron.entrypoints.openai.serving_engine import ChoiceAccumulator, OpenAIServing, RequestTracker
from vllm_neuron.entrypoints.openai.streaming import SSE_DONE, merge_async_iterators, run_until_disconnect, sse
from vllm_neuron.entrypoints.openai.structured import structured_outputs_from_request
from vllm_neuron.outputs import Logprob
from vllm_neuron.structured_output.params import StructuredOutputsParams

_DEFAULT_MAX_TOKENS = 16  # vLLM's and OpenAI's default for this endpoint


def _num_prompts(req: CompletionRequest) -> int:
    """The prompts a completion request holds: its embeddings prompts, then a text, a token list, or a list
    of either."""
    prompt, embeds = req.prompt, req.prompt_embeds
    n = 0 if not embeds else 1 if isinstance(embeds, str) else len(embeds)
    if prompt is None or prompt == "" or prompt == []:
        return max(n, 1)
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return n + len(prompt)
    return n + 1


@dataclass
class _Prompt:
    token_ids: list[int]  # placeholders (0) for an embeddings prompt
    text: str | None
    embeds: Any = None  # torch tensor [len(token_ids), hidden]: the prompt_embeds of an embeddings prompt


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, data: dict[str, Any], raw_request: Request) -> Response:
        arrival = time.monotonic()
        check_unsupported_fields(data, set(CompletionRequest.model_fields), chat=False)
        if data.get("max_tokens", 0) is None:
            data = {**data, "max_tokens": _DEFAULT_MAX_TOKENS}  # vLLM reads null as the default
        req = parse_request(CompletionRequest, data)
        model = self.models.resolve(req.model)
        self.check_engine()
        self.limits.check_n(req.n)
        if req.stream_options is not None and not req.stream:
            raise BadRequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
        self.check_logprobs_cap(req.logprobs, "logprobs")
        self.check_logprobs_cap(req.prompt_logprobs, "prompt_logprobs")
        if req.prompt_embeds:
            self._check_embeds_request(req)
        if req.use_beam_search:
            check_beam_search_request(req)
        structured, structured_param = structured_outputs_from_request(req)
        # Room among the admitted requests before any work (tokenization, grammar).
        return await self.admitted((req.n or 1) * _num_prompts(req), lambda ticket: self._create(
            req, model, structured, structured_param, arrival, ticket, raw_request))

    async def _create(self, req: CompletionRequest, model: str, structured: StructuredOutputsParams | None,
                      structured_param: str | None, arrival: float, ticket: AdmissionTicket,
                      raw_request: Request) -> Response:
        prompts = await self._prompts(req)
        if req.kv_transfer_params is not None and len(prompts) > 1:
            raise BadRequestError("kv_transfer_params applies to one prompt; send the prompts as separate requests",
                                  param="kv_transfer_params")
        echo_only = bool(req.echo) and req.max_tokens == 0
        requested = 1 if echo_only else req.max_tokens
        for p in prompts:
            self.resolve_max_tokens(len(p.token_ids), requested, "max_tokens")
        if structured is not None:
            await self.check_structured_outputs(structured, structured_param, requested)
        request_id = f"cmpl-{self.base_request_id(raw_request, req.request_id)}"
        if req.use_beam_search:  # n is the beam width, not n samples
            ctx = _Ctx(req, model, request_id, prompts, False, int(time.time()), arrival, ticket)
            return await self._beam_search(ctx, beam_search_params(req, requested), raw_request)
        # vLLM's rule: echo with logprobs scores the prompt too (its logprobs lead the echoed tokens').
        prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None else \
            req.logprobs if req.echo else None
        sp = self.build_sampling_params(req, max_tokens=requested, logprobs=req.logprobs,
                                        structured_outputs=structured, prompt_logprobs=prompt_logprobs)
        ctx = _Ctx(req, model, request_id, prompts, echo_only, int(time.time()), arrival, ticket)
        if req.stream:
            return StreamingResponse(self._stream(ctx, sp), media_type="text/event-stream")
        result = await run_until_disconnect(self._full(ctx, sp), raw_request)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(content=result.model_dump())

    async def _beam_search(self, ctx: _Ctx, params, raw_request: Request) -> Response:
        tracker = RequestTracker(self, ctx.arrival, ctx.ticket)
        error: BaseException | None = None
        try:
            result = await run_until_disconnect(beam_search_completion(self, ctx, params, tracker), raw_request)
        except Exception as e:
            error = e
            raise
        finally:
            tracker.close(error)
        return Response(status_code=499) if result is None else JSONResponse(content=result.model_dump())

    def _check_embeds_request(self, req: CompletionRequest) -> None:
        if self.engine.model_info.prompt_embeds_hidden_size is None:
            raise BadRequestError("prompt_embeds requires a server started with --enable-prompt-embeds.",
                                  param="prompt_embeds")
        for field, on in (("echo", req.echo), ("prompt_logprobs", req.prompt_logprobs is not None)):
            if on:  # vLLM's rule: an embeddings prompt has no text or token ids to echo or score
                raise BadRequestError(f"`{field}` cannot be combined with prompt_embeds (the prompt has no tokens).",
                                      param=field)

    async def _embeds_prompts(self, req: CompletionRequest) -> list[_Prompt]:
        from vllm_neuron.engine.prompt_embeds import check_prompt_embeds, decode_prompt_embeds, max_encoded_chars

        hidden = self.engine.model_info.prompt_embeds_hidden_size
        encoded = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else list(req.prompt_embeds)

        def load(item: str):  # decoding megabytes: off the event loop
            t = decode_prompt_embeds(item, max_encoded_chars(self.max_model_len, hidden))
            return check_prompt_embeds(t, hidden, None, self.max_model_len)

        out = []
        for item in encoded:
            try:
                t = await self.run_blocking(load, item)
            except ValueError as e:
                raise BadRequestError(str(e), param="prompt_embeds") from None
            out.append(_Prompt([0] * t.shape[0], None, t))
        return out

    async def _prompts(self, req: CompletionRequest) -> list[_Prompt]:
        raw = req.prompt
        embedded = await self._embeds_prompts(req) if req.prompt_embeds else []
        empty = BadRequestError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        if embedded and (raw is None or raw == "" or raw == []):
            return self._truncated(req, embedded)
        if raw is None or raw == "" or raw == []:
            raise empty
        if isinstance(raw, str):
            items: list[Any] = [raw]
        elif all(isinstance(t, int) for t in raw):
            items = [list(raw)]
        else:
            items = list(raw)
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise empty
                prompts.append(_Prompt(await self.encode(item, req.add_special_tokens,
                                                          bounded=req.truncate_prompt_tokens is None,
                                                          param="prompt"), item))
            else:
                if not item:
                    raise empty
                self.check_token_ids(item, "prompt")
                prompts.append(_Prompt(list(item), None))
        return self._truncated(req, embedded + prompts)

    def _truncated(self, req: CompletionRequest, prompts: list[_Prompt]) -> list[_Prompt]:
        if req.truncate_prompt_tokens is not None:
            keep = self.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
            if keep < 1:
                raise BadRequestError("truncate_prompt_tokens must be -1 or at least 1.",
                                      param="truncate_prompt_tokens")
            for p in prompts:
                if len(p.token_ids) > keep:
                    cut = slice(None, keep) if req.truncation_side == "right" else slice(-keep, None)
                    p.token_ids, p.text = p.token_ids[cut], None
                    if p.embeds is not None:
                        p.embeds = p.embeds[cut]
        return prompts

    def _engine_prompt(self, p: _Prompt) -> TokensPrompt:
        if p.embeds is not None:
            return TokensPrompt(prompt_embeds=p.embeds)
        prompt = TokensPrompt(prompt_token_ids=p.token_ids)
        if p.text is not None:
            prompt["prompt"] = p.text
        return prompt

    def _prompt_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.tokenizer.decode(p.token_ids)

    def _logprobs(self, token_ids: list[int], steps: list[dict[int, Logprob] | None], num_top: int,
                  initial_offset: int, as_ids: bool) -> CompletionLogProbs:
        # Every field passed explicitly: streamed chunks are dumped with exclude_unset.
        out = CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        last_len = 0
        for k, tid in enumerate(token_ids):
            step = steps[k] if k < len(steps) else None
            lp = step.get(tid) if step is not None else None
            tok = self.token_str(tid, lp, as_ids)
            if step is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(self.clamp(lp.logprob) if lp is not None else None)
                top = {self.token_str(t, entry, as_ids): self.clamp(entry.logprob)
                       for t, entry in self.top_entries(step, num_top)}
                if lp is not None:
                    top.setdefault(tok, self.clamp(lp.logprob))  # vLLM lists the sampled token too
                out.top_logprobs.append(top)
            out.tokens.append(tok)
            out.text_offset.append(initial_offset if k == 0 else out.text_offset[-1] + last_len)
            last_len = len(tok)
        return out

    @staticmethod
    def _prompt_steps(p: _Prompt, plp: list | None) -> list:
        """The echoed prompt's logprob steps (None for the first token, which nothing predicts)."""
        return list(plp) if plp is not None else [None] * len(p.token_ids)

    def _generators(self, ctx: _Ctx, sp, tracker: RequestTracker) -> list[AsyncIterator]:
        lora = self.models.lora_request(ctx.model)
        return [self.generate(tracker, self._engine_prompt(p), sp, f"{ctx.request_id}-{i}", len(p.token_ids),
                              ctx.req.priority, lora) for i, p in enumerate(ctx.prompts)]

    async def _full(self, ctx: _Ctx, sp) -> CompletionResponse:
        req, n = ctx.req, sp.n
        tracker = RequestTracker(self, ctx.arrival, ctx.ticket)
        choices = {(i, j): ChoiceAccumulator() for i in range(len(ctx.prompts)) for j in range(n)}
        prompt_lps: dict[int, list] = {}
        error: BaseException | None = None
        kv_transfer_params = None
        try:
            async for i, res in merge_async_iterators(*self._generators(ctx, sp, tracker)):
                kv_transfer_params = res.kv_transfer_params or kv_transfer_params
                if res.prompt_logprobs is not None:
                    prompt_lps[i] = res.prompt_logprobs
                for o in res.outputs:
                    choices[(i, o.index)].add(o)
        except Exception as e:
            error = e
            raise
        finally:
            tracker.close(error)
        as_ids = bool(req.return_tokens_as_token_ids)
        out_choices, completion_tokens = [], 0
        for (i, j), c in sorted(choices.items()):
            p = ctx.prompts[i]
            text, ids, steps = "".join(c.text), c.token_ids, list(c.logprobs)
            finish, stop_reason = c.finish_reason, c.stop_reason
            if ctx.echo_only:
                text, ids, steps, finish, stop_reason = "", [], [], "length", None
            completion_tokens += len(ids)
            logprobs = None
            if req.echo:
                text = self._prompt_text(p) + text
            if req.logprobs is not None:
                lp_ids, lp_steps = (p.token_ids + ids, self._prompt_steps(p, prompt_lps.get(i)) + steps) \
                    if req.echo else (ids, steps)
                logprobs = self._logprobs(lp_ids, lp_steps, req.logprobs, 0, as_ids)
            out_choices.append(CompletionResponseChoice(
                index=i * n + j, text=text, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason,
                token_ids=ids if req.return_token_ids else None,
                prompt_token_ids=p.token_ids if req.return_token_ids else None,
                prompt_logprobs=self.prompt_logprobs_json(prompt_lps.get(i)) if sp.prompt_logprobs is not None
                else None))
        prompt_tokens = sum(len(p.token_ids) for p in ctx.prompts)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        return CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=out_choices,
                                  usage=usage, kv_transfer_params=kv_transfer_params)

    async def _stream(self, ctx: _Ctx, sp) -> AsyncIterator[str]:
        req, n = ctx.req, sp.n
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        as_ids = bool(req.return_tokens_as_token_ids)
        tracker = RequestTracker(self, ctx.arrival, ctx.ticket)
        sent_chars: dict[tuple[int, int], int] = {}
        tokens: dict[tuple[int, int], int] = {}
        finished: set[tuple[int, int]] = set()
        prompt_lps: dict[int, list] = {}
        error: Exception | None = None
        try:
            async for i, res in merge_async_iterators(*self._generators(ctx, sp, tracker)):
                p = ctx.prompts[i]
                if res.prompt_logprobs is not None:
                    prompt_lps[i] = res.prompt_logprobs
                for o in res.outputs:
                    key = (i, o.index)
                    if key in finished:
                        continue
                    if o.finish_reason is not None:
                        finished.add(key)
                    text, ids, steps = o.text, list(o.token_ids), list(o.logprobs or [])
                    finish, stop_reason = o.finish_reason, o.stop_reason
                    if ctx.echo_only:
                        text, ids, steps = "", [], []
                        finish, stop_reason = ("length", None) if finish is not None else (None, None)
                    echoed = req.echo and key not in sent_chars
                    lp_ids, lp_steps = ids, steps
                    if echoed:
                        text = self._prompt_text(p) + text
                        lp_ids, lp_steps = p.token_ids + ids, self._prompt_steps(p, prompt_lps.get(i)) + steps
                    if not text and not ids and finish is None and key in sent_chars:
                        continue
                    offset = sent_chars.get(key, 0)
                    sent_chars[key] = offset + len(text)
                    tokens[key] = tokens.get(key, 0) + len(ids)
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = self._logprobs(lp_ids, lp_steps, req.logprobs, offset, as_ids)
                    choice = CompletionResponseStreamChoice(
                        index=i * n + o.index, text=text, logprobs=logprobs, finish_reason=finish,
                        stop_reason=stop_reason)
                    if req.return_token_ids:
                        choice.token_ids = ids
                        if echoed or offset == 0:
                            choice.prompt_token_ids = p.token_ids
                    chunk = CompletionStreamResponse(id=ctx.request_id, object="text_completion",
                                                     created=ctx.created, model=ctx.model, choices=[choice])
                    if continuous:
                        chunk.usage = UsageInfo(prompt_tokens=len(p.token_ids), completion_tokens=tokens[key],
                                                total_tokens=len(p.token_ids) + tokens[key])
                    yield sse(chunk, exclude_unset=True)
            if include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in ctx.prompts)
                completion_tokens = sum(tokens.values())
                chunk = CompletionStreamResponse(
                    id=ctx.request_id, object="text_completion", created=ctx.created, model=ctx.model, choices=[],
                    usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                    total_tokens=prompt_tokens + completion_tokens))
                yield sse(chunk, exclude_unset=True, exclude_none=True)
        except Exception as e:
            error = e
        finally:
            tracker.close(error)
        if error is not None:
            yield sse(from_exception(error))
        yield SSE_DONE


@dataclass
class _Ctx:
    req: CompletionRequest
    model: str
    request_id: str
    prompts: list[_Prompt]
    echo_only: bool
    created: int
    arrival: float
    ticket: AdmissionTicket | None = None  # released when the request ends (RequestTracker.close)
