"""What one engine step asks of the workers and what comes back.

These dataclasses cross from the scheduler (core/) to the model runner (worker/), possibly over a
process boundary, so they hold plain Python values only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np

from vllm_neuron.sampling_params import SamplingParams


# A decode chunk's input token when async scheduling scheduled it before the previous step's sample
# reached the host: the runner takes the token from the device (the previous step's output).
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class NewRequestData:
    """Sent once, the first time a request is scheduled; the runner keeps its sampling state."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    mm_items: list | None = None  # multimodal.inputs.MultiModalItem per media item
    prompt_embeds: object = None  # [len(prompt_token_ids), hidden] tensor: the prompt's input rows (ids unused)
    pooling_params: object = None  # pooling_params.PoolingParams of a pooling request (its sampling_params unused)
    lora_request: object = None  # lora.request.LoRARequest: the adapter the request runs with (None: the base model)


@dataclass
class ScheduledChunk:
    req_id: str
    token_ids: list[int]  # tokens whose K/V this step computes
    start_pos: int  # position of token_ids[0]; tokens before it are already in the cache
    block_ids: list[int]  # the request's whole block table (KV cache group 0's)
    # The tables of KV cache groups 1.. (kv_cache_groups.py; empty for a one-group model), indexed by
    # block like block_ids; NULL (0) entries are blocks a sliding-window group gave back.
    group_block_ids: tuple[list[int], ...] = ()
    sample: bool = False  # whether this step samples the request's next token
    # Speculative decoding: the last token_ids are this many draft tokens to verify (decode only).
    num_draft_tokens: int = 0


@dataclass
class KVLoadJob:
    """Disaggregated prefill/decode: the blocks of one request to read from the instance that prefilled it."""

    req_id: str
    host: str  # the source instance's KV server (its tensor-parallel rank r listens on port + r)
    port: int
    tp_size: int  # the source's tensor-parallel size
    key: str  # the request's id at the source
    secret: str
    # Per KV cache group: (the source's block ids, the local block ids they go to), in step.
    groups: list[tuple[list[int], list[int]]]
    num_tokens: int = 0  # prompt tokens whose K/V the blocks hold
    engine_id: str = ""  # the source's, as its kv_transfer_params named it (checked by the source)


@dataclass
class TierLoadJob:
    """KV offloading: blocks of one request to read back from the second tier (config/kv_offload.py)."""

    req_id: str
    hashes: list[bytes]  # the blocks' prefix-cache hashes, in order
    blocks: list[int]  # the local blocks they go to


@dataclass
class SchedulerOutput:
    kind: Literal["prefill", "decode"]
    chunks: list[ScheduledChunk]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # runner drops their state
    # Preempted since the last step -> how many output tokens they keep: their KV is gone and they will
    # be prefilled again (from their cached prefix); the runner keeps their sampling state, trimmed to
    # that count (a sample still in flight at preemption is dropped), and frees any batch slot.
    preempted_req_ids: dict[str, int] = field(default_factory=dict)
    # Structured outputs: req_id -> packed allowed-token bitmask (int32 words, xgrammar's layout) for the
    # token this step samples. Requests without a grammar are absent (all tokens allowed).
    grammar_bitmask: dict[str, "np.ndarray"] = field(default_factory=dict)
    # Speculative decoding (decode steps): the requests whose next step may carry drafts proposed after
    # this one; None: every request (prefill steps, or no speculation).
    spec_req_ids: list[str] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_context_tokens(self) -> int:
        return sum(c.start_pos for c in self.chunks)

    @property
    def max_seq_len(self) -> int:
        return max((c.start_pos + len(c.token_ids) for c in self.chunks), default=0)


@dataclass
class StepLogprobs:
    """Per sampled token: (token_id, logprob, rank) entries, the sampled token first."""

    entries: list[tuple[int, float, int]]


@dataclass
class ModelRunnerOutput:
    # req_id -> sampled token ids this step (one, none for a prefill chunk that does not sample, or with
    # speculative decoding the accepted drafts then one more)
    sampled: dict[str, list[int]]
    logprobs: dict[str, StepLogprobs] = field(default_factory=dict)
    bucket_name: str = ""
    num_padding: int = 0  # padded tokens (prefill) or padded sequences (decode)
    # Async scheduling: this step could not take the previous step's tokens straight from the device
    # (the batch changed) and filled its placeholders on the host.
    async_fallback: bool = False
    tokens_passed_on_device: bool = False  # this step's input tokens came from the previous step's output
    # Speculative decoding: req_id -> draft tokens proposed for the request's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Prompt logprobs (requests with prompt_logprobs): req_id -> (first prompt position of this step's share,
    # per position [(prompt token, logprob, rank), top-N...]); position p's entry is token p + 1's.
    prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float, int]]]]] = field(default_factory=dict)
    # Pooling requests whose last prompt chunk ran this step: req_id -> the pooled output (a 1-D float32 CPU
    # tensor); they finish with it and sample nothing.
    pooled: dict[str, object] = field(default_factory=dict)
    # Step timing (worker/step_timing.py; 0 with VLLM_NEURON_STEP_TIMING=0): the runner's execute, and the part
    # of it in bucket graph calls.
    execute_seconds: float = 0.0
    graph_seconds: float = 0.0
