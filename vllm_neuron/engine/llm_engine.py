"""LLMEngine: the synchronous, in-process engine behind the offline `LLM`.

Input processing, the EngineCore step loop and output processing in one thread; the same parts
serve the API server with the core in its own process.
"""
from __future__ import annotations

from typing import Any

from vllm_neuron.lora.request import LoRARequest
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.config.generation_config import effective_generation_config
from vllm_neuron.engine.core import EngineCore
from vllm_neuron.engine.input_processor import (InputProcessor, logits_processor_classes, multimodal_processor,
                                                lora_checker, prompt_embeds_spec)
from vllm_neuron.engine.output_processor import OutputProcessor
from vllm_neuron.engine.resolve import resolve_engine_config
from vllm_neuron.model.loader import Checkpoint, load_checkpoint, load_tokenizer
from vllm_neuron.outputs import PoolingRequestOutput, RequestOutput
from vllm_neuron.pooling_params import PoolingParams
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.structured_output.checker import GrammarChecker


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        ckpt = checkpoint or load_checkpoint(config.model)
        self.checkpoint = ckpt
        self.tokenizer = load_tokenizer(config.tokenizer or ckpt, config.chat_template)
        self.core = EngineCore(config, ckpt)
        vocab_size = ckpt.hf_config.get_text_config().vocab_size
        # In this process: the offline caller is the only user; the engine's time limit still holds.
        checker = GrammarChecker(self.tokenizer, vocab_size, config.grammar_limits, in_process=True)
        self.input_processor = InputProcessor(
            self.tokenizer, config.max_model_len, effective_generation_config(
                config.generation_config, ckpt.generation_config, config.override_generation_config),
            config.neuron_config.on_device_sampling_config, config.max_logprobs,
            vocab_size, multimodal_processor(config, ckpt, self.tokenizer), grammar_check=checker.check,
            scheduling_policy=config.scheduling_policy, kv_transfer=config.kv_transfer is not None,
            prompt_embeds=prompt_embeds_spec(config, ckpt), logits_processors=logits_processor_classes(config),
            pooling=config.pooling, lora=lora_checker(config, ckpt))
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Resolves `args` here (this process received them), then builds the engine."""
        return cls(*resolve_engine_config(args))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "LLMEngine":
        return cls.from_engine_args(EngineArgs.from_kwargs(**kwargs))

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """params: SamplingParams (a generative engine) or PoolingParams (a pooling engine); lora_request: the
        adapter (None: the base model)."""
        text, ids, reqs = self.input_processor.process(request_id, prompt, params, priority, lora_request)
        self.output_processor.add_request(request_id, text, ids, params, reqs)
        for r in reqs:
            self.core.add_request(r)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.core.abort_requests(self.output_processor.engine_ids(request_id))
        return self.output_processor.abort(request_id)

    def shutdown(self) -> None:
        """Ends the engine's other tensor-parallel ranks (nothing to do with one rank)."""
        self.core.shutdown()

    def start_profile(self) -> None:
        """torch.profiler in this process (and the engine's tensor-parallel ranks) until stop_profile();
        profiler.ProfilerError when VLLM_TORCH_PROFILER_DIR is unset or a profile runs already."""
        self.core.start_profile()

    def stop_profile(self) -> list[str]:
        """The trace files written (one per process)."""
        return self.core.stop_profile()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        outs = self.core.step()
        results, to_abort = self.output_processor.process(outs.outputs)
        if to_abort:
            self.core.abort_requests(to_abort, "stop")
        return results
