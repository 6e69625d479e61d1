"""/score and /rerank (/v1/rerank, /v2/rerank) in vLLM's shapes, on a pooling engine.

A cross-encoder (a classification model with one label) scores each (query, document) pair encoded together
(entrypoints/score_utils.py), its sigmoid the score; an embedding model scores the cosine similarity of the
two texts' embeddings (each distinct text embedded once). /rerank orders the documents by that score.
"""
from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse

from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.openai.protocol import UsageInfo
from vllm_neuron.entrypoints.openai.protocol_pooling import (RerankDocument, RerankRequest, RerankResponse,
                                                             RerankResult, RerankUsage, ScoreRequest, ScoreResponse,
                                                             ScoreResponseData)
from vllm_neuron.entrypoints.openai.request_policy import parse_request
from vllm_neuron.entrypoints.openai.serving_pooling import PoolingServingBase
from vllm_neuron.entrypoints.score_utils import broadcast_pairs, cosine_score, pair_token_ids
from vllm_neuron.pooling_params import PoolingParams


class OpenAIServingScore(PoolingServingBase):
    async def create_score(self, data: dict[str, Any], raw_request: Any) -> JSONResponse:
        arrival = time.monotonic()
        self.pooling_setup("Score")
        req = parse_request(ScoreRequest, data)
        name = self.models.resolve(req.model)
        first = req.text_1 if req.text_1 is not None else req.queries
        second = req.text_2 if req.text_2 is not None else req.documents
        if first is None or second is None:
            raise BadRequestError("Give text_1 and text_2 (or queries and documents).",
                                  param="text_1" if first is None else "text_2")
        try:
            pairs = broadcast_pairs(first, second)
        except ValueError as e:
            raise BadRequestError(str(e), param="text_2") from None
        scores, tokens = await self._scores(pairs, req, raw_request, arrival)
        usage = UsageInfo(prompt_tokens=tokens, total_tokens=tokens, completion_tokens=0)
        return JSONResponse(ScoreResponse(model=name, usage=usage, data=[
            ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]).model_dump())

    async def create_rerank(self, data: dict[str, Any], raw_request: Any) -> JSONResponse:
        arrival = time.monotonic()
        self.pooling_setup("Rerank")
        req = parse_request(RerankRequest, data)
        name = self.models.resolve(req.model)
        if not req.documents:
            raise BadRequestError("documents cannot be empty.", param="documents")
        scores, tokens = await self._scores([(req.query, d) for d in req.documents], req, raw_request, arrival)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[:req.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        return JSONResponse(RerankResponse(model=name, usage=RerankUsage(total_tokens=tokens, prompt_tokens=tokens),
                                           results=results).model_dump(exclude_none=True))

    async def _scores(self, pairs: list[tuple[str, str]], req: Any, raw_request: Any,
                      arrival: float) -> tuple[list[float], int]:
        """(one score per pair, prompt tokens the engine pooled)."""
        setup = self.engine.model_info.pooling
        truncating = req.truncate_prompt_tokens is not None
        rid = self.base_request_id(raw_request, req.request_id)
        for q, d in pairs:
            if not isinstance(q, str) or not isinstance(d, str) or not q or not d:
                raise BadRequestError("Every text to score must be a non-empty string.", param="documents")
        if setup.task == "classify":
            if setup.num_labels != 1:
                raise BadRequestError(f"Scores need a cross-encoder with one label; this model has {setup.num_labels}"
                                      " (use /classify).", param="model")
            params = self._params("score", req)
            prompts = []
            for q, d in pairs:
                ids = await self.run_blocking(pair_token_ids, self.tokenizer, q, d)
                if not truncating and len(ids) > self.max_model_len:
                    raise BadRequestError(f"This model's maximum context length is {self.max_model_len} tokens. "
                                          f"However, a (query, document) pair has {len(ids)} tokens. Please reduce "
                                          "its length, or set truncate_prompt_tokens.", param="documents")
                prompts.append({"prompt_token_ids": ids})
            outs = await self.pool(prompts, params, rid, req.priority, arrival, param="documents")
            return [float(o.outputs.data[0]) for o in outs], sum(len(o.prompt_token_ids) for o in outs)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        prompts = [await self.text_prompt(t, req.add_special_tokens, truncating, "documents") for t in texts]
        outs = await self.pool(prompts, self._params("embed", req), rid, req.priority, arrival, param="documents")
        emb = {t: o.outputs.data for t, o in zip(texts, outs)}
        return [cosine_score(emb[q], emb[d]) for q, d in pairs], sum(len(o.prompt_token_ids) for o in outs)

    @staticmethod
    def _params(task: str, req: Any) -> PoolingParams:
        return PoolingParams(task=task, use_activation=req.use_activation if task == "score" else None,
                             truncate_prompt_tokens=req.truncate_prompt_tokens)
