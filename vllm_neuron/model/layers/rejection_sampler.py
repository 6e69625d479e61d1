"""In-graph rejection sampler for speculative decoding (static shapes, no host round trip).

A sequence brings K draft tokens d_1..d_K (the first `num_drafts` real, the rest padding) and the
target's logits at its 1 + K positions: position i's logits give the distribution p_i of the token
after d_i (p_0 follows the last verified token). Walking i = 0..K-1:

* greedy rows accept d_{i+1} while it equals argmax p_i; the first mismatch emits argmax p_i;
* random rows accept d_{i+1} with probability min(1, p_i(d) / q_i(d)), q the draft's distribution
  (a one-hot at d when the draft is deterministic, as n-gram and argmax drafts are); the first
  rejection emits a token drawn from the normalized residual max(0, p_i - q_i), which makes every
  emitted token distributed exactly as the target alone would sample it;
* when all real drafts are accepted, a bonus token is drawn from p_{num_drafts}.

p is the distribution the ordinary in-graph sampler draws from (temperature, top-k, top-p), so
speculation changes nothing but speed. Randomness comes in as uniforms from the host.
"""
from __future__ import annotations

import torch

from vllm_neuron.model.layers.in_graph_sampler import _GREEDY_EPS, DEFAULT_MAX_TOP_K, filtered_top_probs, inverse_cdf


def rejection_sample(logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     uniform_accept: torch.Tensor, uniform_sample: torch.Tensor, *,
                     all_greedy: bool = False, draft_probs: torch.Tensor | None = None,
                     max_top_k: int = DEFAULT_MAX_TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, K + 1], num_emitted [B]): row b emits tokens[b, :num_emitted[b]], i.e. its
    accepted drafts then one corrected or bonus token; entries past that are -1.

    logits [B, K + 1, V]; draft_ids [B, K] int64; num_drafts [B] int64 in 0..K; temperature / top_k /
    top_p [B] as the in-graph sampler; uniform_accept [B, K], uniform_sample [B, K + 1] in [0, 1);
    draft_probs [B, K, V] or None for one-hot drafts. `all_greedy` is a per-graph constant.
    """
    b, k1, vocab = logits.shape
    k = k1 - 1
    logits = logits.float()
    pos = torch.arange(k1, device=logits.device)
    greedy_tok = torch.argmax(logits, dim=-1)  # [B, K + 1]
    drafts = draft_ids.clamp(min=0)
    real = pos[None, :k] < num_drafts[:, None]  # [B, K]
    greedy_accept = drafts == greedy_tok[:, :k]
    if all_greedy:
        accept = greedy_accept & real
    else:
        flat = logits.reshape(b * k1, vocab)
        rep = lambda t: t.repeat_interleave(k1)  # noqa: E731 - per-row params to per-position rows
        probs, top_idx = filtered_top_probs(flat, rep(temperature), rep(top_k), rep(top_p), max_top_k)
        total = probs.sum(-1, keepdim=True)
        p = (probs / total).view(b, k1, -1)  # normalized, top-k space
        top_idx = top_idx.view(b, k1, -1)
        is_draft = top_idx[:, :k] == drafts[:, :, None]  # [B, K, k]
        p_draft = (p[:, :k] * is_draft).sum(-1)  # p_i(d_{i+1})
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
            q_top = is_draft.float()
        else:
            q_draft = draft_probs.float().gather(-1, drafts[:, :, None]).squeeze(-1)
            q_top = draft_probs.float().gather(-1, top_idx[:, :k])
        random_accept = uniform_accept * q_draft < p_draft  # u < p / q without dividing by q = 0
        is_greedy = (temperature < _GREEDY_EPS)[:, None]
        accept = torch.where(is_greedy, greedy_accept, random_accept) & real
        # A real draft position emits only on rejection: from the residual. Any other position emits
        # only as the bonus: from p. A residual with no mass (p == q) can never be reached (its draft is
        # accepted surely), so p stands in there to keep the draw well defined.
        resid = (p[:, :k] - q_top).clamp(min=0)
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p[:, :k])
        real_pos = torch.cat([real, torch.zeros_like(real[:, :1])], dim=1)
        dist = torch.where(real_pos[:, :, None], torch.cat([resid, p[:, k:]], dim=1), p)
        choice = inverse_cdf(dist.reshape(b * k1, -1), uniform_sample.reshape(-1))
        sampled = top_idx.reshape(b * k1, -1).gather(1, choice[:, None]).view(b, k1)
        greedy_tok = torch.where(is_greedy, greedy_tok, sampled)
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(1)  # [B]
    last = greedy_tok.gather(1, num_accepted[:, None])  # correction or bonus at position num_accepted
    out = torch.where(pos[None, :] < num_accepted[:, None], torch.cat([drafts, drafts[:, :1]], dim=1),
                      torch.full_like(greedy_tok, -1))
    out = out.scatter(1, num_accepted[:, None], last)
    return out, num_accepted + 1
