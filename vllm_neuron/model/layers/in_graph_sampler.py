"""In-graph ("on-device") sampling: greedy, temperature, top-k, top-p, per row.

Runs inside the compiled graph of every bucket, so it uses static shapes only: no `.item()`, no
Python branch on tensor values. Randomness comes in as one uniform number per row (drawn on the host
from the request's own generator when it has a seed), so the graph itself is deterministic.
"""
from __future__ import annotations

import torch

# Below this temperature a row is greedy (same threshold as SamplingParams).
_GREEDY_EPS = 1e-5
# The seeds: "When top_k is set to -1, it is internally limited to 256".
DEFAULT_MAX_TOP_K = 256


def greedy_in_graph(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64 argmax, for all-greedy configurations."""
    return torch.argmax(logits, dim=-1)


def filtered_top_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, max_top_k: int = DEFAULT_MAX_TOP_K
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution a random row samples from, in top-k space: (probs [B, k] unnormalized over the
    kept tokens, zero elsewhere; top_idx [B, k] their token ids), k = min(max_top_k, V).

    softmax of logits / temperature restricted to the top min(top_k, max_top_k) tokens, then to the
    smallest prefix of those whose mass reaches top_p. Greedy rows (temperature 0) get temperature 1
    here; callers pick their argmax instead.
    """
    vocab = logits.shape[-1]
    k = min(max_top_k, vocab)  # a Python int: shapes are static per compiled graph
    logits = logits.to(torch.float32)
    is_greedy = temperature < _GREEDY_EPS

    # Top-k of the raw logits: dividing by a positive temperature does not change the order.
    top_vals, top_idx = torch.topk(logits, k, dim=-1)
    safe_temp = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    scaled = top_vals / safe_temp.unsqueeze(1)

    positions = torch.arange(k, device=logits.device).unsqueeze(0)
    k_eff = torch.where(top_k <= 0, torch.full_like(top_k, k), top_k.clamp(max=k))
    in_top_k = positions < k_eff.unsqueeze(1)
    scaled = scaled.masked_fill(~in_top_k, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)

    # A token stays if the mass of the tokens before it is below top_p; the first always stays,
    # and top_p = 1 keeps all (rounding must not drop the tail).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = in_top_k & ((mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1) | (positions == 0))
    return probs * keep, top_idx


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of unnormalized probs [B, k] (zeros never drawn) with uniform [B]."""
    cdf = torch.cumsum(probs, dim=-1)
    target = uniform.to(torch.float32).unsqueeze(1) * cdf[:, -1:]
    choice = (cdf <= target).sum(dim=-1)
    # Rounding at the top end must not step past the last token with mass.
    last = probs.shape[-1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(choice, last)


def sample_in_graph(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, uniform: torch.Tensor,
                    max_top_k: int = DEFAULT_MAX_TOP_K) -> torch.Tensor:
    """Samples one token per row.

    logits [B, V]; temperature [B] f32 (0 = greedy); top_k [B] int64 (<= 0: max_top_k);
    top_p [B] f32 in (0, 1]; uniform [B] f32 in [0, 1). Returns [B] int64 token ids, drawn from
    `filtered_top_probs` (inverse CDF on the unnormalized kept mass: same as renormalizing).
    """
    greedy_tokens = torch.argmax(logits, dim=-1)
    probs, top_idx = filtered_top_probs(logits, temperature, top_k, top_p, max_top_k)
    sampled = top_idx.gather(1, inverse_cdf(probs, uniform).unsqueeze(1)).squeeze(1)
    return torch.where(temperature < _GREEDY_EPS, greedy_tokens, sampled)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Masks disallowed tokens to -inf. bitmask [B, ceil(V / 32)] int32, bit j of word w allows token
    32 * w + j (xgrammar's layout); an all-ones row (-1 words) allows everything. Static shapes."""
    vocab = logits.shape[-1]
    idx = torch.arange(vocab, device=logits.device)
    words = bitmask[:, idx >> 5]
    allowed = ((words >> (idx & 31)) & 1).bool()
    return logits.masked_fill(~allowed, float("-inf"))
