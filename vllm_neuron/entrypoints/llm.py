"""The offline `LLM`: vLLM's Python API over the in-process engine; with data_parallel_size > 1, over
the server's engine client (one process per replica, the same router) on a private event loop."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from vllm_neuron.beam_search import BeamSearch, BeamSearchOutput
from vllm_neuron.sampling_params import BeamSearchParams
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.engine.llm_engine import LLMEngine
from vllm_neuron.engine.resolve import resolve_engine_config
from vllm_neuron.frame_stack import call_with_room
from vllm_neuron.lora.request import LoRARequest
from vllm_neuron.model.loader import Checkpoint
from vllm_neuron.entrypoints.openai.chat_template import normalize_messages
from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.score_utils import broadcast_pairs, cosine_score, pair_token_ids
from vllm_neuron.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                                 RequestOutput, ScoringRequestOutput)
from vllm_neuron.pooling_params import PoolingParams
from vllm_neuron.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """`LLM(model=None, **engine_options)`: model is a HF directory or a .gguf file (None: the bundled
    SmolLM2-135M-Instruct). Engine options take vLLM's names (max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, num_gpu_blocks_override, enable_prefix_caching, enforce_eager,
    dtype, seed, device, additional_config={"neuron_config": {...}}, ...)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self._init(EngineArgs.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm._init(args)
        return llm

    def _init(self, args: EngineArgs) -> None:
        self._counter = itertools.count()
        self._dp: _DataParallelEngine | None = None
        if args.lora_modules:
            raise ValueError("lora_modules is the server's option (--lora-modules); offline, pass "
                             "lora_request=LoRARequest(name, id, path) to generate")
        config, ckpt = resolve_engine_config(args)  # once, here: the engines get it resolved
        if config.data_parallel_size > 1:
            self._dp = _DataParallelEngine(config, ckpt)
            weakref.finalize(self, self._dp.shutdown)
            self.llm_engine = None
        else:
            self.llm_engine = LLMEngine(config, ckpt)
            # Its threads (a KV connector's) and tensor-parallel ranks end with this object, not the process.
            weakref.finalize(self, self.llm_engine.shutdown)

    def start_profile(self) -> None:
        """Starts torch.profiler in every process of the engine (vLLM's API). VLLM_TORCH_PROFILER_DIR must name the
        folder for the traces: without it, or with a profile running, a ProfilerError (a RuntimeError) says so."""
        if self._dp is not None:
            self._dp.loop.run_until_complete(self._dp.client.start_profile())
        else:
            self.llm_engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stops the profile; the trace files written, one per process (Chrome trace JSON, for Perfetto)."""
        if self._dp is not None:
            return self._dp.loop.run_until_complete(self._dp.client.stop_profile())
        return self.llm_engine.stop_profile()

    def get_tokenizer(self):
        return (self._dp or self.llm_engine).tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return (self._dp or self.llm_engine).input_processor.default_sampling_params()

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, a list of such lists, or prompt
        dicts ({"prompt": ...} / {"prompt_token_ids": [...]}).
        priority: one per prompt, lower first (needs scheduling_policy="priority"), as vLLM's.
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base model; needs
        enable_lora=True)."""
        prompts = self._as_prompt_list(prompts)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora_requests")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        requests = []
        for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
            if p.output_kind != RequestOutputKind.FINAL_ONLY:
                p = p.clone()
                p.output_kind = RequestOutputKind.FINAL_ONLY
            requests.append((str(next(self._counter)), prompt, p, prio, lora))
        return self._submit_and_run(requests, use_tqdm)

    def _submit_and_run(self, requests: list[tuple], use_tqdm: bool) -> list:
        """(request id, prompt, SamplingParams or PoolingParams, priority[, LoRARequest]) each -> their final
        outputs, in order; a failure aborts those already added."""
        if self._dp is not None:
            return self._dp.run(requests, use_tqdm)
        ids = []
        try:
            for rid, prompt, p, prio, *lora in requests:
                self.llm_engine.add_request(rid, prompt, p, prio, *lora)
                ids.append(rid)
            # The loop under a frame stack chunk of its own: no step maps and unmaps frame memory (frame_stack.py).
            return call_with_room(self._run, ids, use_tqdm)
        except BaseException:
            for rid in ids:
                self.llm_engine.abort_request(rid)
            raise

    # -- pooling models (--runner pooling): one pooled output per prompt -------------------------------------
    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output (`outputs.data`, a float tensor) from a pooling model; prompts as
        `generate`'s. pooling_task: embed / classify / score / encode (default: the model's)."""
        prompts = self._as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [(pooling_params or PoolingParams()).clone() for _ in prompts]
        else:
            params = [p.clone() for p in pooling_params]
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} pooling_params")
        overrides = {k: v for k, v in (("task", pooling_task), ("truncate_prompt_tokens", truncate_prompt_tokens))
                     if v is not None}
        params = [dataclasses.replace(p, **overrides) for p in params]  # checked like the constructor's
        return self._submit_and_run([(str(next(self._counter)), prompt, p, 0) for prompt, p in zip(prompts, params)],
                                    use_tqdm)

    def embed(self, prompts: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`, a list of floats) from an embedding model."""
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: Any, *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (`outputs.probs`) from a classification model."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: Any, data_2: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """One score per (data_1, data_2) pair (one text against many, or pairs in order): a cross-encoder's
        (a classification model with one label: the pair encoded together), else the cosine similarity of an
        embedding model's two embeddings."""
        pairs = broadcast_pairs(data_1, data_2)
        pooling = (self._dp or self.llm_engine).input_processor.pooling
        if pooling is None:
            raise ValueError("LLM.score needs a pooling model (--runner pooling); this one generates")
        params = pooling_params or PoolingParams()
        if pooling.task == "classify":
            if pooling.num_labels != 1:
                raise ValueError(f"LLM.score needs a cross-encoder with one label; this model has "
                                 f"{pooling.num_labels} (use LLM.classify)")
            tok = self.get_tokenizer()
            prompts = [{"prompt_token_ids": pair_token_ids(tok, q, d)} for q, d in pairs]
            outs = self.encode(prompts, params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                               pooling_task="score")
            return [ScoringRequestOutput.from_score(o, float(o.outputs.data[0])) for o in outs]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embs = self.encode(texts, params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           pooling_task="embed")
        by_text = dict(zip(texts, embs))
        return [ScoringRequestOutput.from_score(by_text[d], cosine_score(by_text[q].outputs.data,
                                                                         by_text[d].outputs.data))
                for q, d in pairs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations. With a
        multimodal model, content parts may carry media: {"type": "image_url", "image_url": {"url": ...}}
        (data:, file:// under allowed_local_media_path, http(s)), {"type": "image", "image": PIL image}.
        lora_request: the LoRA adapter of every conversation (as `generate`'s)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        multimodal = (self._dp or self.llm_engine).input_processor.mm_processor is not None
        prompts = []
        for conv in convs:
            media: dict[str, list] | None = {} if multimodal else None
            try:
                conv = normalize_messages(conv, media)
            except BadRequestError as e:  # the server's 400 is the offline API's ValueError
                raise ValueError(e.message) from None
            ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message,
                                          chat_template=chat_template, **(chat_template_kwargs or {}))
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids), **({"multi_modal_data": media} if media else {})})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: Any, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `params.beam_width` best sequences (vllm_neuron/beam_search.py
        says how), prompt tokens included, most likely first."""
        engine = self._dp or self.llm_engine
        tok = self.get_tokenizer()
        ids = []
        for p in self._as_prompt_list(prompts):
            if isinstance(p, dict) and "prompt_token_ids" in p:
                ids.append(list(p["prompt_token_ids"]))
            elif isinstance(p, (str, dict)):
                ids.append(tok.encode(p if isinstance(p, str) else p["prompt"], add_special_tokens=True))
            else:
                ids.append(list(p))

        search = BeamSearch(ids, params, engine.input_processor.eos_token_id, engine.input_processor.max_model_len)
        while (beams := search.next_step()) is not None:
            outs = self.generate([{"prompt_token_ids": b} for b in beams], search.step_params, use_tqdm=use_tqdm)
            search.advance([o.outputs[0].logprobs[0] for o in outs])
        best = search.results()
        for seqs in best:
            for s in seqs:
                s.text = tok.decode(s.tokens, skip_special_tokens=True)
        return [BeamSearchOutput(seqs) for seqs in best]

    def _as_prompt_list(self, prompts: Any) -> list[Any]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or None, unit="req")
        out_tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if isinstance(out, RequestOutput):
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"output: {out_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s")
        bar.close()
        return [done[i] for i in ids]


class _DataParallelEngine:
    """The replicas of LLM(data_parallel_size=N): AsyncLLM (engine/async_llm.py) driven to completion."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        from vllm_neuron.engine.async_llm import AsyncLLM

        self.loop = asyncio.new_event_loop()
        self.client = AsyncLLM(config, checkpoint)
        try:
            self.loop.run_until_complete(self.client.wait_until_ready())
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = self.client.tokenizer
        self.input_processor = self.client.input_processor

    def run(self, requests: list[tuple], use_tqdm: bool) -> list[RequestOutput]:
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm or None, unit="req")

        async def one(rid: str, prompt: Any, params: SamplingParams, priority: int, lora=None) -> RequestOutput:
            final = None
            async for out in self.client.generate(prompt, params, rid, priority, lora):
                final = out
            bar.update(1)
            return final

        async def every() -> list[RequestOutput]:
            return await asyncio.gather(*(one(*r) for r in requests))  # a failure cancels (aborts) the rest

        try:
            return self.loop.run_until_complete(every())
        finally:
            bar.close()

    def shutdown(self) -> None:
        if self.loop.is_closed():
            return
        self.client.shutdown()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop runs in this thread: let the cancelled output task end in its own
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()
        # else: a finalizer called from inside another loop (garbage collection): the loop is left to be collected
