"""`use_beam_search` on /v1/completions (vLLM's field): `n` beams per prompt, built step by step on the engine's
generation (vllm_neuron/beam_search.py); each choice is one beam, best first. Not streamed, and without
logprobs, echo or structured outputs (refused with a 400 naming the field)."""
from __future__ import annotations

import asyncio
from typing import Any

from vllm_neuron.beam_search import BeamSearch
from vllm_neuron.engine.protocol import TokensPrompt
from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.openai.protocol import (CompletionRequest, CompletionResponse, CompletionResponseChoice,
                                                     UsageInfo)
from vllm_neuron.sampling_params import BeamSearchParams

_REFUSED_WITH_BEAMS = ("stream", "logprobs", "echo", "prompt_logprobs", "prompt_embeds", "response_format",
                       "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def check_beam_search_request(req: CompletionRequest) -> None:
    for name in _REFUSED_WITH_BEAMS:
        value = getattr(req, name, None)
        if value not in (None, False, [], "", {}):
            raise BadRequestError(f"`{name}` cannot be combined with use_beam_search on this server.", param=name)


def beam_search_params(req: CompletionRequest, max_tokens: int) -> BeamSearchParams:
    try:
        return BeamSearchParams(beam_width=req.n or 1, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as e:
        raise BadRequestError(str(e), param="n") from None


async def beam_search_completion(serving: Any, ctx: Any, params: BeamSearchParams, tracker: Any
                                 ) -> CompletionResponse:
    """ctx: serving_completion's request context (prompts, ids); serving: its OpenAIServingCompletion."""
    eos = serving.engine.model_info.eos_token_id
    search = BeamSearch([p.token_ids for p in ctx.prompts], params, eos, serving.max_model_len)
    step = 0

    async def one(tokens: list[int], i: int) -> dict:
        out = None
        async for res in serving.generate(tracker, TokensPrompt(prompt_token_ids=tokens), search.step_params,
                                          f"{ctx.request_id}-beam{step}-{i}", len(tokens),
                                          lora_request=serving.models.lora_request(ctx.model)):
            out = res
        return out.outputs[0].logprobs[0]

    while (beams := search.next_step()) is not None:
        search.advance(list(await asyncio.gather(*(one(b, i) for i, b in enumerate(beams)))))
        step += 1
    choices, completion_tokens = [], 0
    for i, (p, seqs) in enumerate(zip(ctx.prompts, search.results())):
        for j, s in enumerate(seqs):
            ids = s.tokens[len(p.token_ids):]
            text_ids = ids[:-1] if s.finish_reason == "stop" else ids  # vLLM leaves EOS out of the text
            completion_tokens += len(ids)
            choices.append(CompletionResponseChoice(
                index=i * params.beam_width + j, text=serving.tokenizer.decode(text_ids, skip_special_tokens=True),
                finish_reason=s.finish_reason, token_ids=ids if ctx.req.return_token_ids else None,
                prompt_token_ids=p.token_ids if ctx.req.return_token_ids else None))
    prompt_tokens = sum(len(p.token_ids) for p in ctx.prompts)
    return CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices,
                              usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                              total_tokens=prompt_tokens + completion_tokens))
