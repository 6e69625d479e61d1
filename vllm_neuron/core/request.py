"""A request as the scheduler sees it: token ids, progress and status (no tensors, no text)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from vllm_neuron.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @classmethod
    def from_finish_reason(cls, reason: str) -> "RequestStatus":
        return {"stop": cls.FINISHED_STOPPED, "length": cls.FINISHED_LENGTH, "abort": cls.FINISHED_ABORTED}[reason]


@dataclass(eq=False)  # identity: queue membership tests must not compare token lists
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Keys that must match besides the tokens for a prefix-cache hit (e.g. image hashes, LoRA).
    cache_salt: tuple = ()
    mm_items: list | None = None  # media items (opaque here; the runner encodes them)
    # --scheduling-policy priority: lower runs first (vLLM's convention); ties go by arrival.
    priority: int = 0
    prompt_embeds: object = None  # [num_prompt_tokens, hidden] tensor (opaque here; the runner's input rows)
    pooling_params: object = None  # a pooling request's PoolingParams (opaque here): prefill only, then it finishes
    lora_request: object = None  # its LoRA adapter (lora/request.py's LoRARequest; None: the base model)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose K/V are in the cache or being written by a scheduled step (advanced when scheduled).
    num_computed_tokens: int = 0
    # Sampled tokens of scheduled steps that have not reached the scheduler yet (async scheduling).
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not scheduled yet)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of full computed blocks, chained
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next decode step

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    @property
    def is_prefilling(self) -> bool:
        """True while tokens other than the newest sampled one (known or pending) still lack K/V."""
        pending = self.num_output_placeholders
        return self.num_computed_tokens < self.num_tokens + pending - 1 or not (self.output_token_ids or pending)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
