"""/v1/embeddings, /pooling and /classify in vLLM's shapes, on a pooling engine (--runner pooling).

Every prompt of a request is one engine request (batched by the scheduler like any prefill), admitted
together before any work; text is tokenized off the event loop (with the checkpoint's sentence-transformers
default prompt in front), then the engine pools it. A generative model answers these routes with a 400, as
a pooling model answers /v1/completions and /v1/chat/completions (the engine refuses sampling there).
"""
from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from vllm_neuron import metrics
from vllm_neuron.engine.protocol import EngineOverloadedError
from vllm_neuron.entrypoints.openai.errors import BadRequestError, ServiceUnavailableError
from vllm_neuron.entrypoints.openai.protocol import UsageInfo
from vllm_neuron.entrypoints.openai.protocol_pooling import (ClassificationData, ClassificationRequest,
                                                             ClassificationResponse, EmbeddingRequest,
                                                             EmbeddingResponse, EmbeddingResponseData, PoolingRequest,
                                                             PoolingResponse, PoolingResponseData)
from vllm_neuron.entrypoints.openai.request_policy import parse_request
from vllm_neuron.entrypoints.openai.serving_engine import OpenAIServing
from vllm_neuron.outputs import PoolingRequestOutput
from vllm_neuron.pooling_params import PoolingParams


def encode_floats(values: list[float] | Any, encoding_format: str) -> list[float] | str:
    """`float`: a JSON list; `base64`: the little-endian float32 bytes, as OpenAI's and vLLM's servers send."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return [float(v) for v in values]


def _param_named(message: str, default: str) -> str:
    """The request field an engine refusal is about (its message starts with or names it)."""
    for field in ("dimensions", "truncate_prompt_tokens", "priority", "task"):
        if message.startswith(field) or f" {field} " in message:
            return field
    return default


class PoolingServingBase(OpenAIServing):
    """What the pooling routes share: the pooler check, prompts, admission and the engine requests."""

    def pooling_setup(self, api: str):
        setup = self.engine.model_info.pooling
        if setup is None:
            raise BadRequestError(f"The model does not support the {api} API: it is a generative model (start a "
                                  "pooling model: --runner pooling / --convert embed|classify).", param="model")
        return setup

    async def text_prompt(self, text: str, add_special_tokens: bool, truncating: bool, param: str) -> dict:
        if not text:
            raise BadRequestError("Input cannot be empty: give a non-empty string or token ids.", param=param)
        text = self.engine.model_info.pooling.text_prompt(text)
        ids = await self.encode(text, add_special_tokens, bounded=not truncating, param=param)
        return {"prompt": text, "prompt_token_ids": ids}

    async def input_prompts(self, inp: Any, add_special_tokens: bool, truncating: bool,
                            param: str = "input") -> list[dict]:
        """The prompts of an `input` field: a string, token ids, or a list of either."""
        if isinstance(inp, str):
            inp = [inp]
        elif inp and all(isinstance(t, int) for t in inp):
            inp = [inp]
        if not inp:
            raise BadRequestError("Input cannot be empty: give a non-empty string or token ids.", param=param)
        out = []
        for item in inp:
            if isinstance(item, str):
                out.append(await self.text_prompt(item, add_special_tokens, truncating, param))
            elif not item:
                raise BadRequestError("Input cannot be empty: a token-id prompt has no tokens.", param=param)
            else:
                self.check_token_ids(item, param)
                out.append({"prompt_token_ids": list(item)})
        return out

    async def pool(self, prompts: list[dict], params: PoolingParams, request_id: str, priority: int,
                   arrival: float, param: str = "input") -> list[PoolingRequestOutput]:
        """Each prompt pooled by the engine (one engine request each, admitted together); a refused prompt
        is the request's 400 and its other prompts are aborted."""
        self.check_engine()

        async def one(i: int, prompt: dict) -> PoolingRequestOutput:
            rid = f"{request_id}-{i}"
            timer = metrics.RequestTimer(len(prompt["prompt_token_ids"]), arrival) if self.record_metrics else None
            final = None
            try:
                async for out in self.engine.encode(prompt, params, rid, priority):
                    final = out
            except ValueError as e:
                raise BadRequestError(str(e), param=_param_named(str(e), param)) from e
            except EngineOverloadedError as e:
                raise ServiceUnavailableError(str(e), headers={"Retry-After": str(e.retry_after_s)}) from e
            finally:
                if timer is not None:
                    timer.finish("stop" if final is not None else "abort")
            return final

        async def work(ticket) -> list[PoolingRequestOutput]:
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(one(i, p)) for i, p in enumerate(prompts)]
            except BaseExceptionGroup as eg:  # the first failure is the request's answer
                raise eg.exceptions[0] from None
            finally:
                ticket.release()
            return [t.result() for t in tasks]

        return await self.admitted(len(prompts), work)

    @staticmethod
    def usage(outs: list[PoolingRequestOutput]) -> UsageInfo:
        n = sum(len(o.prompt_token_ids) for o in outs)
        return UsageInfo(prompt_tokens=n, total_tokens=n, completion_tokens=0)


class OpenAIServingPooling(PoolingServingBase):
    async def create_embedding(self, data: dict[str, Any], raw_request: Any) -> JSONResponse:
        return await self._vectors(data, raw_request, "Embeddings", EmbeddingRequest, lambda name, usage, vecs:
                                   EmbeddingResponse(model=name, usage=usage, data=[
                                       EmbeddingResponseData(index=i, embedding=v) for i, v in enumerate(vecs)]))

    async def create_pooling(self, data: dict[str, Any], raw_request: Any) -> JSONResponse:
        return await self._vectors(data, raw_request, "Pooling", PoolingRequest, lambda name, usage, vecs:
                                   PoolingResponse(model=name, usage=usage, data=[
                                       PoolingResponseData(index=i, data=v) for i, v in enumerate(vecs)]))

    async def _vectors(self, data: dict[str, Any], raw_request: Any, api: str, request_cls: type,
                       respond: Any) -> JSONResponse:
        """/v1/embeddings (the embed task) and /pooling (the model's own task): one float vector per input."""
        arrival = time.monotonic()
        setup = self.pooling_setup(api)
        req = parse_request(request_cls, data)
        name = self.models.resolve(req.model)
        outs = await self._pool_input(req, "embed" if request_cls is EmbeddingRequest else setup.task, raw_request,
                                      arrival)
        vecs = [encode_floats(o.outputs.data.tolist(), req.encoding_format) for o in outs]
        return JSONResponse(respond(name, self.usage(outs), vecs).model_dump())

    async def create_classify(self, data: dict[str, Any], raw_request: Any) -> JSONResponse:
        arrival = time.monotonic()
        setup = self.pooling_setup("Classification")
        req = parse_request(ClassificationRequest, data)
        name = self.models.resolve(req.model)
        outs = await self._pool_input(req, "classify", raw_request, arrival)
        data_out = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = int(np.argmax(probs))
            label = setup.labels[best] if best < len(setup.labels) else None
            data_out.append(ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs)))
        return JSONResponse(ClassificationResponse(model=name, usage=self.usage(outs), data=data_out).model_dump())

    async def _pool_input(self, req: Any, task: str, raw_request: Any, arrival: float) -> list[PoolingRequestOutput]:
        try:
            params = PoolingParams(task=task, dimensions=getattr(req, "dimensions", None),
                                   normalize=getattr(req, "normalize", None),
                                   use_activation=getattr(req, "use_activation", None),
                                   truncate_prompt_tokens=req.truncate_prompt_tokens)
        except ValueError as e:
            raise BadRequestError(str(e), param=_param_named(str(e), "input")) from None
        prompts = await self.input_prompts(req.input, req.add_special_tokens, req.truncate_prompt_tokens is not None)
        return await self.pool(prompts, params, self.base_request_id(raw_request, req.request_id), req.priority,
                               arrival)
