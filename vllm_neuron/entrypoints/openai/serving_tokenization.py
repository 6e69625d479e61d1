"""/tokenize and /detokenize in vLLM's shapes (a prompt, or chat messages through the template)."""
from __future__ import annotations

from typing import Any

from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllm_neuron.entrypoints.openai.serving_chat import check_generation_prompt_flags
from vllm_neuron.entrypoints.openai.request_policy import parse_request
from vllm_neuron.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, data: dict[str, Any]) -> TokenizeResponse:
        if "messages" in data:
            check_generation_prompt_flags(data)
            chat = parse_request(TokenizeChatRequest, data)
            self.models.resolve(chat.model)
            media: dict[str, list] | None = {} if self.engine.is_multimodal else None
            text = await self.render_chat(chat.messages, request_template=chat.chat_template,
                                          add_generation_prompt=chat.add_generation_prompt,
                                          continue_final_message=chat.continue_final_message,
                                          template_kwargs=chat.chat_template_kwargs, tools=chat.tools, media=media)
            # vLLM's /tokenize counts prompts of any length (no max_model_len check): only the body limit bounds
            # them, and the API server gives the memory back after a large one (http_edge.HeapTrim).
            ids = await self.encode(text, chat.add_special_tokens, bounded=False)
            if media:  # the media's placeholder tokens count, as the model will see them
                try:
                    ids, _ = await self.run_blocking(self.engine.process_multimodal, ids, media)
                except ValueError as e:
                    raise BadRequestError(str(e), param="messages") from None
            want_strs = chat.return_token_strs
        elif "prompt" in data:
            req = parse_request(TokenizeCompletionRequest, data)
            self.models.resolve(req.model)
            ids = await self.encode(req.prompt, req.add_special_tokens, bounded=False)
            want_strs = req.return_token_strs
        else:
            raise BadRequestError("Either `prompt` or `messages` must be given.", param="prompt")
        strs = await self.run_blocking(self.tokenizer.convert_ids_to_tokens, ids) if want_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, data: dict[str, Any]) -> DetokenizeResponse:
        req = parse_request(DetokenizeRequest, data)
        self.models.resolve(req.model)
        self.check_token_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=await self.run_blocking(self.tokenizer.decode, req.tokens))
