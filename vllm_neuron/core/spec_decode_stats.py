"""Speculative-decoding counters (vLLM's `vllm:spec_decode_*`), cumulative since start (pure)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int = 0
    num_drafts: int = 0  # verification rows that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [K]: drafts accepted at position i

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def cumulative(self) -> tuple[int, int, int, list[int]] | None:
        """(drafts, draft tokens, accepted tokens, accepted per position); None without speculation."""
        if not self.num_speculative_tokens:
            return None
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification row: the accepted drafts plus the one the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
