"""Prompts and sampling parameters in, validated EngineCoreRequests out (one per completion when n > 1)."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vllm_neuron.lora.peft_adapter import AdapterChecker, BaseShapes
from vllm_neuron.lora.request import LoRARequest
from vllm_neuron.config.generation_config import sampling_defaults
from vllm_neuron.config.kv_transfer import parse_kv_transfer_params
from vllm_neuron.logger import init_logger
from vllm_neuron.engine.messages import EngineCoreRequest
from vllm_neuron.config.neuron_config import OnDeviceSamplingConfig
from vllm_neuron.model.registry import is_multimodal, resolve_model_class
from vllm_neuron.pooling_params import PoolingParams
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from vllm_neuron.multimodal.processor import MultiModalProcessor

logger = init_logger(__name__)


def multimodal_processor(config, ckpt, tokenizer) -> "MultiModalProcessor | None":
    """The media processor of a multimodal checkpoint (None for a text model)."""
    if not is_multimodal(ckpt.hf_config):
        return None
    from vllm_neuron.config.neuron_config import EncoderNeuronConfig
    from vllm_neuron.multimodal.processor import MultiModalProcessor

    if "audio" in getattr(resolve_model_class(ckpt.hf_config), "modalities", ()):
        if config.ec_transfer_config is not None:
            raise ValueError("ec_transfer_config: encoder-disaggregated serving moves vision embeddings "
                             "(Qwen3-VL); this audio model encodes its clips itself")
        return audio_processor(config, ckpt)
    enc = config.additional_config.encoder_neuron_config or EncoderNeuronConfig()
    return MultiModalProcessor(ckpt.hf_config, ckpt.path, mm_processor_kwargs=config.mm_processor_kwargs,
                               limits=config.limit_mm_per_prompt,
                               allowed_local_media_path=config.allowed_local_media_path,
                               allowed_media_domains=config.allowed_media_domains,
                               language_model_only=_media_refused(config),
                               max_frame_patches=enc.encoder_attention_block_size, tokenizer=tokenizer,
                               embeddings_available=_encoded_elsewhere(config, ckpt))


def _media_refused(config) -> bool:
    """A text-tower-only engine refuses media, unless an EC connector brings their embeddings (EPD)."""
    ec = config.ec_transfer_config
    return config.additional_config.mm_language_model_only and (ec is None or not ec.is_consumer)


def _encoded_elsewhere(config, ckpt):
    """has(mm_hash) of the EC connector of an EPD prefill+decode instance without the vision tower (an existence
    check only: the runner reads an item when its encoder cache lacks it); None for any other engine."""
    ec = config.ec_transfer_config
    if not config.additional_config.mm_language_model_only or ec is None or not ec.is_consumer:
        return None
    from vllm_neuron.distributed.ec_transfer.connectors import make_ec_connector
    from vllm_neuron.distributed.ec_transfer.record import model_identity

    return _Admitted(make_ec_connector(ec, model_identity(ckpt.hf_config.to_dict(), config.model)).has)


class _Admitted:
    """has(mm_hash) remembered once true (the most recent `size` items): an item this instance already took is
    not asked for again; the runner's encoder cache holds it, or reads it when it evicted it."""

    def __init__(self, has: Callable[[str], bool], size: int = 4096) -> None:
        self.has, self.size = has, size
        self.seen: dict[str, None] = {}

    def __call__(self, mm_hash: str) -> bool:
        if mm_hash in self.seen:
            self.seen[mm_hash] = self.seen.pop(mm_hash)  # most recent last
            return True
        if not self.has(mm_hash):
            return False
        self.seen[mm_hash] = None
        if len(self.seen) > self.size:
            del self.seen[next(iter(self.seen))]
        return True


def audio_processor(config, ckpt):
    """An audio model's processor; its clips must fit the largest audio encoder bucket."""
    from vllm_neuron.model.qwen3_asr.config import AudioArchConfig, audio_encoder_buckets
    from vllm_neuron.multimodal.audio_processor import AudioProcessor

    buckets = audio_encoder_buckets(config.additional_config, AudioArchConfig.from_hf(ckpt.hf_config.audio_config))
    return AudioProcessor(ckpt.hf_config, ckpt.path, limits=config.limit_mm_per_prompt,
                          allowed_local_media_path=config.allowed_local_media_path,
                          allowed_media_domains=config.allowed_media_domains,
                          language_model_only=config.additional_config.mm_language_model_only,
                          max_blocks=buckets[-1], mm_processor_kwargs=config.mm_processor_kwargs)


def logits_processor_classes(config) -> tuple[type, ...]:
    from vllm_neuron.logits_processor import load_logits_processor

    return tuple(load_logits_processor(s) for s in config.logits_processors or ())


def prompt_embeds_spec(config, ckpt) -> tuple[int, Any] | None:
    """(hidden size, dtype) a prompt's embeddings must fit with --enable-prompt-embeds; None without it."""
    if not config.enable_prompt_embeds:
        return None
    return ckpt.hf_config.get_text_config().hidden_size, config.torch_dtype


def lora_checker(config, ckpt) -> AdapterChecker | None:
    """The adapter check of an engine with LoRA on (None: LoRA off, adapters refused)."""
    if config.lora is None:
        return None
    return AdapterChecker(BaseShapes.from_hf_config(ckpt.hf_config), config.lora.max_lora_rank)


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, generation_config: Mapping[str, Any],
                 odsc: OnDeviceSamplingConfig | None, max_logprobs: int, vocab_size: int,
                 mm_processor: "MultiModalProcessor | None" = None,
                 grammar_check: Callable[[StructuredOutputsParams, int | None], None] | None = None,
                 scheduling_policy: str = "fcfs", kv_transfer: bool = False,
                 prompt_embeds: tuple[int, Any] | None = None, logits_processors: tuple[type, ...] = (),
                 pooling: Any = None, lora: AdapterChecker | None = None) -> None:
        """grammar_check(params, max_tokens): a structured-output constraint's size limits and compilation
        (structured_output/checker.py; ValueError naming the problem); None: compiled here, unbounded.
        scheduling_policy: a request `priority` other than 0 is refused unless it is "priority" (vLLM's rule).
        kv_transfer: the engine is a disaggregated instance (requests may carry kv_transfer_params).
        prompt_embeds: (hidden size, torch dtype) of the model with --enable-prompt-embeds; None: refused.
        logits_processors: the custom processors' classes, whose validate_params refuse a request here.
        pooling: a pooling engine's PoolingSetup (config/pooler_config.py): requests bring PoolingParams.
        lora: the adapter check with LoRA on (`lora_checker`); None: a request's adapter is refused."""
        self.lora = lora
        self.pooling = pooling
        self.prompt_embeds = prompt_embeds
        self.logits_processors = logits_processors
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        self.kv_transfer = kv_transfer
        self.grammar_check = grammar_check
        self.mm_processor = mm_processor
        self.max_model_len = max_model_len
        self.odsc = odsc
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs  # -1: the whole vocabulary
        self.vocab_size = vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        eos = generation_config.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        if self.eos_token_id is None and eos_list:
            self.eos_token_id = eos_list[0]
        # Further EOS ids of the generation config stop generation like stop_token_ids (as in vLLM).
        self.extra_eos_ids = [e for e in eos_list if e != self.eos_token_id]
        self.generation_defaults = sampling_defaults(generation_config)
        if self.generation_defaults:
            logger.info("Default sampling parameters from the generation config (request fields override them; "
                        "--generation-config vllm for vLLM's neutral defaults): %s", self.generation_defaults)

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's default: the model's generation_config, then on-device sampling defaults."""
        kwargs = dict(self.generation_defaults)
        if self.odsc is not None:
            kwargs.update(self.odsc.request_defaults())
        return SamplingParams(**kwargs)

    def tokenize_multimodal(self, prompt: Any) -> tuple[str | None, list[int], list | None]:
        """(text, token ids with media placeholders expanded, media items or None)."""
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_items"):
            if self.mm_processor is None:
                raise ValueError("media inputs are not supported by this model (it takes text only)")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"]), list(prompt["multi_modal_items"])
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data"):
            if self.mm_processor is None:
                raise ValueError("multi_modal_data is not supported by this model (it takes text only)")
            text, ids = self._tokenize(prompt)
            ids, items = self.mm_processor.process(ids, prompt["multi_modal_data"], prompt.get("mm_processor_kwargs"))
            return text, ids, items or None
        text, ids = self._tokenize(prompt)
        if self.mm_processor is not None:  # placeholders without media would reach the model as text
            ids, _ = self.mm_processor.process(ids, {})
        return text, ids, None

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"], add_special_tokens=True)
            if "prompt_embeds" in prompt:
                raise ValueError("prompt_embeds requires the engine option enable_prompt_embeds "
                                 "(--enable-prompt-embeds)")
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}")

    def process(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams,
                priority: int = 0, lora_request: LoRARequest | None = None,
                ) -> tuple[str | None, list[int], list[EngineCoreRequest]]:
        self.check_priority(priority)
        self.check_lora(lora_request)
        if isinstance(params, PoolingParams) or self.pooling is not None:
            if lora_request is not None:
                raise ValueError("LoRA adapters are not supported by pooling models")
            return self._process_pooling(request_id, prompt, params, priority)
        embeds = None
        if isinstance(prompt, Mapping) and "prompt_embeds" in prompt and self.prompt_embeds is not None:
            text, ids, mm_items, embeds = self._embeds_prompt(prompt, params)
        else:
            text, ids, mm_items = self.tokenize_multimodal(prompt)
        self.validate(ids, params)
        params = params.clone()
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        if self.extra_eos_ids and not params.ignore_eos:
            params.stop_token_ids = list(dict.fromkeys(list(params.stop_token_ids) + self.extra_eos_ids))
        if params.bad_words:
            params._bad_words_token_ids = self._bad_words_ids(params.bad_words)
        now = time.monotonic()
        if params.n == 1:
            return text, ids, [EngineCoreRequest(request_id, ids, params, self.eos_token_id, now, mm_items,
                                                 priority=priority, prompt_embeds=embeds, lora_request=lora_request)]
        reqs = []
        for i in range(params.n):
            child = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            reqs.append(EngineCoreRequest(child_request_id(i, request_id), ids, child, self.eos_token_id, now,
                                          mm_items, priority=priority, prompt_embeds=embeds,
                                          lora_request=lora_request))
        return text, ids, reqs

    def _process_pooling(self, request_id: str, prompt: Any, params: Any,
                         priority: int) -> tuple[str | None, list[int], list[EngineCoreRequest]]:
        """A pooling request: its prompt (truncated to its last `truncate_prompt_tokens` tokens when asked)
        prefilled once, no sampling (the SamplingParams it carries only satisfies the scheduler's fields)."""
        if self.pooling is None:
            raise ValueError("This model does not support pooling (embeddings, classification, scores): it is a "
                             "generative model. Start a pooling model (--runner pooling / --convert embed).")
        if not isinstance(params, PoolingParams):
            raise ValueError(f"This model is a pooling model ({self.pooling.task}): it does not generate text; "
                             "use its embed / classify / score endpoints")
        params = params.verify(self.pooling.task, self.pooling.hidden_size, self.pooling.matryoshka)
        if isinstance(prompt, str):
            prompt = self.pooling.text_prompt(prompt)  # sentence-transformers' default prompt and lower-casing
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("The prompt cannot be empty")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if keep > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                                 f"({self.max_model_len}). Please, select a smaller truncation size.")
            ids = ids[-keep:]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {len(ids)} tokens in the input. Please reduce the length of the input, or "
                             "set truncate_prompt_tokens.")
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        return text, ids, [EngineCoreRequest(request_id, ids, sp, self.eos_token_id, time.monotonic(),
                                             priority=priority, pooling_params=params)]

    def check_lora(self, lora_request: Any) -> None:
        """A request's adapter: a LoRARequest whose folder fits the base model, with LoRA on."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest (vllm_neuron.lora.request), got "
                             f"{type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled: start "
                             "the engine with enable_lora=True (--enable-lora)")
        self.lora.check(lora_request)

    def check_priority(self, priority: Any) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but priority scheduling is not enabled: start the engine "
                             "with --scheduling-policy priority (scheduling_policy='priority'), or send priority 0")

    def _embeds_prompt(self, prompt: Mapping, params: SamplingParams) -> tuple[None, list[int], None, Any]:
        """{"prompt_embeds": tensor}: (no text, placeholder ids, no media, the checked tensor)."""
        from vllm_neuron.engine.prompt_embeds import check_prompt_embeds

        extra = sorted(set(prompt) - {"prompt_embeds", "cache_salt"})
        if extra:
            raise ValueError(f"a prompt_embeds prompt takes no other input, got {extra}")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with prompt_embeds: the prompt has no token ids "
                             "to score")
        hidden, dtype = self.prompt_embeds
        embeds = check_prompt_embeds(prompt["prompt_embeds"], hidden, dtype, self.max_model_len)
        return None, [0] * embeds.shape[0], None, embeds

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size})")
        n = len(ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {n}) is longer than the maximum model length of "
                f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the number of "
                f"text tokens plus the number of tokens to generate.")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + params.max_tokens} tokens ({n} in the messages, {params.max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.")
        if params.prompt_logprobs is not None:
            wanted = self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
            if wanted > self.max_logprobs:
                raise ValueError(f"Requested prompt logprobs of {wanted}, which is greater than max allowed: "
                                 f"{self.max_logprobs}")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"Requested sample logprobs of {params.logprobs}, which is greater than "
                             f"max allowed: {self.max_logprobs}")
        if params.structured_outputs is not None:
            self._validate_structured_outputs(params)
        for t in list(params.logit_bias or ()) + list(params.allowed_token_ids or ()):
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} in logit_bias/allowed_token_ids is out of vocabulary "
                                 f"(vocab size {self.vocab_size})")
        if self.odsc is not None:
            self.odsc.check_request(params.temperature)
        ktp = (params.extra_args or {}).get("kv_transfer_params")
        if ktp is not None:
            parse_kv_transfer_params(ktp)
            if not self.kv_transfer:
                raise ValueError("kv_transfer_params needs an engine started with kv_transfer_config "
                                 "(--kv-transfer-config); this one is not a disaggregated instance")
            if params.n != 1:
                raise ValueError(f"kv_transfer_params supports n=1 only, got n={params.n}")
        for cls in self.logits_processors:
            check = getattr(cls, "validate_params", None)
            if check is not None:
                check(params)  # a ValueError refuses the request (vLLM's hook)

    def _validate_structured_outputs(self, params: SamplingParams) -> None:
        # Checked here (compiled once, remembered by its text) so a bad constraint is refused before it reaches
        # the engine.
        if self.grammar_check is not None:
            self.grammar_check(params.structured_outputs, params.max_tokens)
            return
        from vllm_neuron.structured_output.compiler import make_tokenizer_info, validate

        validate(params.structured_outputs, make_tokenizer_info(self.tokenizer))

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        out = []
        for w in words:
            for variant in (w, " " + w.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out
