"""Host ("CPU") sampling with vLLM V1 semantics, for what the in-graph sampler does not do.

Order per row, as vLLM V1's Sampler: raw logprobs (log_softmax of the model's logits) ->
allowed_token_ids -> bad words -> min_tokens suppression -> logit_bias -> repetition / frequency /
presence penalties -> greedy argmax, or temperature -> min_p -> top-k -> top-p -> random sample.
Each stage is one batched op over the rows that need it, not a loop over rows: on a busy CPU every
parallel op over the vocabulary can cost a scheduler wake-up (measured: ~5 ms each on 2 cores).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_neuron.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class HostSamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # the request's own generator when params.seed is set
    stop_token_ids_for_min_tokens: Sequence[int]  # EOS + stop ids, banned while output < min_tokens
    bad_words_token_ids: Sequence[Sequence[int]] = ()


@dataclass
class HostSampleResult:
    token_ids: list[int]
    # Per row: [(token_id, logprob, rank)], the sampled token first, then the top-N; None if not asked.
    logprobs: list[list[tuple[int, float, int]] | None]


def _padded(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(q) for q in seqs))
    return torch.tensor([list(q) + [pad] * (width - len(q)) for q in seqs], dtype=torch.long, device=device)


def _banned_positions(row: HostSamplingRow) -> list[int]:
    """Tokens this row may not produce next: bad-word endings and, before min_tokens, stops."""
    banned: list[int] = []
    out = row.output_token_ids
    for word in row.bad_words_token_ids:
        # A bad word's last token is banned only when the output ends with the word's other tokens.
        prefix_len = len(word) - 1
        if prefix_len > len(out):
            continue
        if prefix_len == 0 or list(out[len(out) - prefix_len:]) == list(word[:-1]):
            banned.append(word[-1])
    if len(out) < row.params.min_tokens:
        banned.extend(row.stop_token_ids_for_min_tokens)
    return banned


def _has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def _apply_penalties(x: torch.Tensor, idx: list[int], rows: Sequence[HostSamplingRow]) -> None:
    """Repetition counts prompt and output; frequency and presence count only the output."""
    vocab = x.shape[1]
    dev = x.device
    out_ids = _padded([rows[i].output_token_ids for i in idx], vocab, dev)
    # One spare column catches the padding.
    counts = torch.zeros(len(idx), vocab + 1, device=dev).scatter_add_(
        1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))[:, :vocab]
    in_output = counts > 0
    sub = x[idx]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=dev).unsqueeze(1)

    rep = [rows[i].params.repetition_penalty for i in idx]
    if any(r != 1.0 for r in rep):
        prompt_ids = _padded([rows[i].prompt_token_ids for i in idx], vocab, dev)
        seen = torch.zeros(len(idx), vocab + 1, dtype=torch.bool, device=dev).scatter_(
            1, prompt_ids, True)[:, :vocab] | in_output
        r = column(rep)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    freq = [rows[i].params.frequency_penalty for i in idx]
    if any(f != 0.0 for f in freq):
        sub = sub - column(freq) * counts
    pres = [rows[i].params.presence_penalty for i in idx]
    if any(p != 0.0 for p in pres):
        sub = sub - column(pres) * in_output
    x[idx] = sub


def _process_logits(x: torch.Tensor, rows: Sequence[HostSamplingRow]) -> None:
    """Applies, in place, the edits that can change the argmax. Bans and biases commute
    (-inf + b = -inf); only the penalties must come after the bias."""
    vocab = x.shape[1]
    dev = x.device
    allowed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if allowed:
        ids = _padded([rows[i].params.allowed_token_ids for i in allowed], vocab, dev)
        keep = torch.zeros(len(allowed), vocab + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)
        x[allowed] = x[allowed].masked_fill(~keep[:, :vocab], float("-inf"))
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for i, row in enumerate(rows):
        if row.bad_words_token_ids or len(row.output_token_ids) < row.params.min_tokens:
            banned = _banned_positions(row)
            ban_rows += [i] * len(banned)
            ban_cols += banned
        if row.params.logit_bias:
            bias_rows += [i] * len(row.params.logit_bias)
            bias_cols += list(row.params.logit_bias.keys())
            bias_vals += list(row.params.logit_bias.values())
    if ban_rows:
        x[torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)] = float("-inf")
    if bias_rows:
        x.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev)),
                     torch.tensor(bias_vals, dtype=x.dtype, device=dev), accumulate=True)
    penalized = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
    if penalized:
        _apply_penalties(x, penalized, rows)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """top_k: [N] int (vocab size = off); top_p: [N] float (1.0 = off)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        # Ties with the k-th value stay in, as in vLLM (a threshold, not a count).
        kth = sorted_logits.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < p.
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p.unsqueeze(1)
        # Rounding can push the running mass to 1.0 before the tail; p = 1 must keep every token.
        drop &= (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _random_sample(probs: torch.Tensor, rows: Sequence[HostSamplingRow]) -> torch.Tensor:
    # Exponential race (argmax of p / q, q ~ Exp(1)) equals sampling from p. Seeded rows draw q from
    # their own generator, so their result does not depend on the rest of the batch.
    q = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        if len(unseeded) == len(rows):
            q.exponential_()
        else:
            q[unseeded] = torch.empty_like(probs[unseeded]).exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            q[i].exponential_(generator=r.generator)
    return (probs / q).argmax(dim=-1)


def _gather_logprobs(raw_logprobs: torch.Tensor, token_ids: list[int],
                     counts: list[int]) -> list[list[tuple[int, float, int]]]:
    """raw_logprobs [M, V] of the rows that asked; counts[j] = top-N wanted (-1: whole vocab)."""
    vocab = raw_logprobs.shape[1]
    chosen = torch.tensor(token_ids, dtype=torch.long, device=raw_logprobs.device).unsqueeze(1)
    chosen_lp = raw_logprobs.gather(1, chosen)
    # Rank counts the tokens at least as likely, so the best token has rank 1.
    ranks = (raw_logprobs >= chosen_lp).sum(dim=-1).tolist()
    wanted = [vocab if c == -1 else min(c, vocab) for c in counts]
    top_n = max(wanted)
    if top_n > 0:
        values, indices = torch.topk(raw_logprobs, top_n, dim=-1)
        values, indices = values.tolist(), indices.tolist()
    results = []
    for j, token_id in enumerate(token_ids):
        entry = [(token_id, float(chosen_lp[j, 0]), int(ranks[j]))]
        entry += [(indices[j][r], values[j][r], r + 1) for r in range(wanted[j])]
        results.append(entry)
    return results


def _sample_random(x: torch.Tensor, rows: Sequence[HostSamplingRow]) -> torch.Tensor:
    """Temperature -> min_p -> top-k -> top-p -> sample, for rows with temperature > 0."""
    dev = x.device
    vocab = x.shape[1]
    temp = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=dev)
    x = x / temp.unsqueeze(1)
    min_p_rows = [j for j, r in enumerate(rows) if r.params.min_p > 0.0]
    if min_p_rows:
        min_p = torch.tensor([rows[j].params.min_p for j in min_p_rows], dtype=torch.float32, device=dev)
        x[min_p_rows] = _apply_min_p(x[min_p_rows], min_p)
    # Rows without truncation skip the sort entirely (and keep every token exactly).
    trunc_rows = [j for j, r in enumerate(rows) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
    if trunc_rows:
        ks = [rows[j].params.top_k if 0 < rows[j].params.top_k < vocab else vocab for j in trunc_rows]
        ps = [rows[j].params.top_p for j in trunc_rows]
        x[trunc_rows] = _apply_top_k_top_p(
            x[trunc_rows],
            torch.tensor(ks, dtype=torch.long, device=dev) if any(k < vocab for k in ks) else None,
            torch.tensor(ps, dtype=torch.float32, device=dev) if any(p < 1.0 for p in ps) else None)
    return _random_sample(torch.softmax(x, dim=-1), rows)


def host_sample(logits: torch.Tensor, rows: Sequence[HostSamplingRow]) -> HostSampleResult:
    """Samples one token per row of logits [N, V] with each row's SamplingParams."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [num_rows, vocab] with num_rows={len(rows)}, "
                         f"got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    # fp32 always: penalties and softmax in bf16 would change which token wins.
    x = logits.to(torch.float32, copy=True)

    want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    # vLLM's default logprobs mode (raw_logprobs): the model's distribution before any processing.
    raw_logprobs = torch.log_softmax(x[want_logprobs], dim=-1) if want_logprobs else None

    _process_logits(x, rows)

    greedy = [r.params.temperature < SAMPLING_EPS for r in rows]
    sampled = torch.empty(num_rows, dtype=torch.long, device=x.device)
    if any(greedy):
        sampled[:] = x.argmax(dim=-1)
    random_idx = [i for i in range(num_rows) if not greedy[i]]
    if random_idx:
        sampled[random_idx] = _sample_random(x[random_idx], [rows[i] for i in random_idx])

    token_ids = sampled.tolist()
    logprobs: list[list[tuple[int, float, int]] | None] = [None] * num_rows
    if want_logprobs:
        gathered = _gather_logprobs(raw_logprobs, [token_ids[i] for i in want_logprobs],
                                    [rows[i].params.logprobs for i in want_logprobs])
        for i, entry in zip(want_logprobs, gathered):
            logprobs[i] = entry
    return HostSampleResult(token_ids=token_ids, logprobs=logprobs)
