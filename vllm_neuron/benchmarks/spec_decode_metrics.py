"""Speculative-decoding figures of a benchmark run, from the server's `vllm:spec_decode_*` counters.

`bench serve` reads /metrics before and after the run (as vLLM's does); the difference gives the
run's drafts, draft tokens and accepted tokens, hence the acceptance rate and the mean acceptance
length (tokens emitted per verification: 1 + accepted / drafts). A server without speculation exposes
no such counters, and nothing is printed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

_PREFIX = "vllm:spec_decode_"


@dataclass
class SpecDecodeCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)

    def minus(self, before: "SpecDecodeCounters") -> "SpecDecodeCounters":
        return SpecDecodeCounters(
            self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            {p: n - before.accepted_per_pos.get(p, 0.0) for p, n in self.accepted_per_pos.items()})

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def parse_spec_decode_counters(text: str) -> SpecDecodeCounters | None:
    """The counters summed over label sets (model names, processes); None when the server has none."""
    out, seen = SpecDecodeCounters(), False
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(_PREFIX):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # _created timestamps
            seen = True
            key = sample.name[len(_PREFIX):-len("_total")]
            if key == "num_accepted_tokens_per_pos":
                pos = int(sample.labels["position"])
                out.accepted_per_pos[pos] = out.accepted_per_pos.get(pos, 0.0) + sample.value
            elif key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                setattr(out, key, getattr(out, key) + sample.value)
    return out if seen else None


async def fetch_spec_decode_counters(client: httpx.AsyncClient, base_url: str,
                                     headers: dict[str, str]) -> SpecDecodeCounters | None:
    """None when /metrics is unreachable or has no speculative-decoding counters."""
    try:
        resp = await client.get(f"{base_url}/metrics", headers=headers)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_spec_decode_counters(resp.text)


def format_spec_decode_section(c: SpecDecodeCounters, width: int = 50) -> str:
    """vLLM's "Speculative Decoding" block of the result table."""
    def row(label: str, value, fmt: str = "") -> str:
        return f"{label:<40} {value:<10{fmt}}"

    lines = [f"{'Speculative Decoding':-^{width}}",
             row("Acceptance rate (%):", 100 * c.acceptance_rate, ".2f"),
             row("Acceptance length:", c.acceptance_length, ".2f"),
             row("Drafts:", int(c.num_drafts)),
             row("Draft tokens:", int(c.num_draft_tokens)),
             row("Accepted tokens:", int(c.num_accepted_tokens))]
    if c.num_drafts:
        lines.append("Per-position acceptance (%):")
        lines += [row(f"  Position {p}:", 100 * n / c.num_drafts, ".2f") for p, n in sorted(c.accepted_per_pos.items())]
    return "\n".join(lines)


def spec_decode_result(c: SpecDecodeCounters) -> dict:
    """Result-file keys (vLLM's names)."""
    return {"spec_decode_acceptance_rate": 100 * c.acceptance_rate, "spec_decode_acceptance_length": c.acceptance_length,
            "spec_decode_num_drafts": int(c.num_drafts), "spec_decode_draft_tokens": int(c.num_draft_tokens),
            "spec_decode_accepted_tokens": int(c.num_accepted_tokens)}
