"""Messages between the front end (input/output processing) and the EngineCore.

Plain dataclasses, so they can be sent over a socket as msgpack when the core runs in its own process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    mm_items: list | None = None  # multimodal.inputs.MultiModalItem per media item, in prompt order
    priority: int = 0  # --scheduling-policy priority: lower first
    # --enable-prompt-embeds: [len(prompt_token_ids), hidden] in the model's dtype (the ids are placeholders).
    prompt_embeds: Any = None
    pooling_params: Any = None  # pooling_params.PoolingParams: a pooling request (sampling_params unused)
    lora_request: Any = None  # lora.request.LoRARequest: the adapter (None: the base model)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    # Per new token: [(token_id, logprob, rank)], the sampled token first; None if not asked.
    new_logprobs: list[list[tuple[int, float, int]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # with finish_reason "error": why the engine failed this request
    # Whose fault the error is (structured_output's GRAMMAR_INVALID / GRAMMAR_BUSY): "invalid" the request's (a
    # 400: its grammar failed or compiled too long), "busy" the engine's capacity (a 503), None a fault (500).
    error_kind: str | None = None
    # A prefill instance's answer for the decode instance (vLLM's kv_transfer_params), on the final output.
    kv_transfer_params: dict | None = None
    # With the request's first token, when it asked for prompt_logprobs: per prompt position 1.. the
    # [(prompt token, logprob, rank), top-N...] entries.
    prompt_logprobs: list[list[tuple[int, float, int]]] | None = None
    pooled: Any = None  # a pooling request's output: 1-D float32 CPU tensor, on its final output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0  # cumulative, in tokens
    prefix_hits: int = 0
    num_preemptions: int = 0  # cumulative
    num_async_sync_fallbacks: int = 0  # cumulative
    # Speculative decoding (cumulative; None without --speculative-config): drafts, draft tokens,
    # accepted tokens, accepted tokens per draft position.
    spec_decode: tuple[int, int, int, list[int]] | None = None
    # Encoder cache hits and misses in media items (cumulative; None without a multimodal model).
    encoder_cache: tuple[int, int, int] | None = None  # hits, misses, evictions
    grammar_cache_bytes: int = 0  # compiled grammars the structured-output compiler keeps
    grammar_compile_timeouts: int = 0  # cumulative
    # Disaggregated prefill/decode (None without --kv-transfer-config): engine/kv_transfer.py's stats().
    kv_transfer: tuple | None = None
    # KV offloading (None without --kv-offloading-size): engine/kv_tier.py's stats().
    kv_offload: tuple | None = None
    # LoRA (None when off): (max_loras, adapters of running requests, adapters of waiting ones).
    lora: tuple | None = None
    step_kind: str = ""
    bucket_name: str = ""
    num_padding: int = 0
    num_tokens: int = 0
    num_seqs: int = 0  # the step's sequences (chunks)
    context_len: int = 0  # the step's longest sequence, its new tokens included
    execute_seconds: float = 0.0  # the runner's step (0: VLLM_NEURON_STEP_TIMING=0)
    graph_seconds: float = 0.0  # of which in bucket graph calls


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None
