"""Host ("CPU") sampling with vLLM V1 semantics, for what the in-graph sampler does not do.

Order per row, as vLLM V1's Sampler: raw logprobs (log_softmax of the model's logits; --logprobs-mode
raw_logits: the logits themselves) ->
allowed_token_ids -> bad words -> min_tokens suppression -> logit_bias -> repetition / frequency /
presence penalties -> custom processors -> greedy argmax, or temperature -> min_p -> argmax-invariant custom
processors -> top-k -> top-p -> random sample. min_tokens, logit_bias and min_p are vLLM's built-in logits
processors (worker/builtin_logits_processors.py), run here through that interface.
With --logprobs-mode processed_logprobs / processed_logits the logprobs come from the logits the token is
drawn from: after those edits, and for random rows temperature, min_p, top-k and top-p (-inf outside).
Temperature, top-k, top-p and the draw are the in-graph sampler's own function (`sample_in_graph`) with
the row's `counter_uniform` number, so a row sampled here gets the token the graph would have given it
from the same logits.
Each stage is one batched op over the rows that need it, not a loop over rows: on a busy CPU every
parallel op over the vocabulary can cost a scheduler wake-up (measured: ~5 ms each on 2 cores).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_neuron.model.layers.in_graph_sampler import sample_in_graph, truncated_logits
from vllm_neuron.sampling_params import SAMPLING_EPS, SamplingParams
from vllm_neuron.worker.builtin_logits_processors import ARGMAX_CHANGING, MinPLogitsProcessor, one_step_update


# The custom processors: (logits of every row, argmax_invariant) -> the processed logits.
CustomProcessors = Callable[[torch.Tensor, bool], torch.Tensor]


@dataclass
class HostSamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    uniform: float  # the row's random number, counter_uniform(seed, position)
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
    """Tokens this row may not produce next: bad-word endings."""
    banned: list[int] = []
    out = row.output_token_ids
    for word in row.bad_words_token_ids:
        # A bad word's last token is banned only when the output ends with the word's other tokens.
        prefix_len = len(word) - 1
        if prefix_len > len(out):
            continue
        if prefix_len == 0 or list(out[len(out) - prefix_len:]) == list(word[:-1]):
            banned.append(word[-1])
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


def _builtin(processor_types: tuple, rows: Sequence[HostSamplingRow]) -> list:
    """The built-in processors of `processor_types` that some row uses, told this step's rows."""
    update = one_step_update([r.params for r in rows], [r.prompt_token_ids for r in rows],
                             [r.output_token_ids for r in rows])
    used = []
    for cls in processor_types:
        p = cls()
        p.update_state(update)
        if p.rows:
            used.append(p)
    return used


def _process_logits(x: torch.Tensor, rows: Sequence[HostSamplingRow]) -> torch.Tensor:
    """Applies the edits that can change the argmax: allowed tokens, bad words, then min_tokens and logit_bias
    (processors, builtin_logits_processors.py), then the penalties."""
    vocab = x.shape[1]
    dev = x.device
    allowed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if allowed:
        ids = _padded([rows[i].params.allowed_token_ids for i in allowed], vocab, dev)
        keep = torch.zeros(len(allowed), vocab + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)
        x[allowed] = x[allowed].masked_fill(~keep[:, :vocab], float("-inf"))
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    for i, row in enumerate(rows):
        if row.bad_words_token_ids:
            banned = _banned_positions(row)
            ban_rows += [i] * len(banned)
            ban_cols += banned
    if ban_rows:
        x[torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)] = float("-inf")
    for p in _builtin(ARGMAX_CHANGING, rows):
        x = p.apply(x)
    penalized = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
    if penalized:
        _apply_penalties(x, penalized, rows)
    return x


def _scale_random_rows(x: torch.Tensor, rows: Sequence[HostSamplingRow], random_idx: list[int],
                       custom: CustomProcessors | None) -> None:
    """vLLM's order after the edits, in place on the random rows: divide by the temperature, then the
    argmax-invariant processors on the scaled logits (min_p, MinPLogitsProcessor; then the custom ones, which
    see every row: greedy rows unscaled, as their argmax is all that counts)."""
    temp = torch.tensor([rows[i].params.temperature for i in random_idx], dtype=torch.float32, device=x.device)
    scaled = x[random_idx] / temp.unsqueeze(1)
    for p in _builtin((MinPLogitsProcessor,), [rows[i] for i in random_idx]):
        scaled = p.apply(scaled)
    x[random_idx] = scaled
    if custom is not None:
        x[:] = custom(x, True).to(torch.float32)


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


def _sample_random(x: torch.Tensor, rows: Sequence[HostSamplingRow], max_top_k: int,
                   use_kernels: bool = False) -> torch.Tensor:
    """top-k -> top-p -> sample, for rows with temperature > 0 whose logits are already scaled."""
    dev = x.device
    vocab = x.shape[1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
    top_p = [r.params.top_p for r in rows]
    # The threshold search needs the largest top_k (or the top-p cap) of the batch; none at all
    # when no row truncates.
    width = max([*top_k, max_top_k if any(p < 1.0 for p in top_p) else 1])
    return sample_in_graph(x, torch.ones(len(rows), dtype=torch.float32, device=dev),
                           torch.tensor(top_k, dtype=torch.long, device=dev),
                           torch.tensor(top_p, dtype=torch.float32, device=dev),
                           torch.tensor([r.uniform for r in rows], dtype=torch.float32, device=dev),
                           max_top_k=max_top_k, width=width, use_kernels=use_kernels)


def _processed_logits(x: torch.Tensor, rows: Sequence[HostSamplingRow], max_top_k: int) -> torch.Tensor:
    """The logits each row's token is drawn from (x: after the edits, random rows scaled and min_p'd): greedy
    rows as they are, random rows -inf outside their top-k / top-p set."""
    dev, vocab = x.device, x.shape[1]
    temp = torch.tensor([1.0 if r.params.temperature >= SAMPLING_EPS else 0.0 for r in rows],
                        dtype=torch.float32, device=dev)
    top_k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows], device=dev)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=dev)
    return truncated_logits(x, temp, top_k, top_p, max_top_k)


def host_sample(logits: torch.Tensor, rows: Sequence[HostSamplingRow], max_top_k: int | None = None,
                logprobs_mode: str = "raw_logprobs",
                custom: CustomProcessors | None = None, use_kernels: bool = False) -> HostSampleResult:
    """Samples one token per row of logits [N, V] with each row's SamplingParams. max_top_k: how many
    tokens top-p looks at when top_k is off (the in-graph sampler's cap; None: the whole vocabulary);
    logprobs_mode: one of config/engine_args.py's LOGPROBS_MODES (vLLM's --logprobs-mode); custom: the custom
    logits processors over every row (worker/logits_processors.py): custom(x, False) applies those that can
    change the argmax, after the edits; custom(x, True) the argmax-invariant ones, after the temperature;
    use_kernels: the random rows' draw takes the graphs' CPU kernel (the engine's KernelConfig.sampler), so a
    seeded row draws the same token here as in the graph."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [num_rows, vocab] with num_rows={len(rows)}, "
                         f"got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    # fp32 always: penalties and softmax in bf16 would change which token wins.
    x = logits.to(torch.float32, copy=True)

    want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    # vLLM's default logprobs mode (raw_logprobs): the model's distribution before any processing.
    reported = None
    if want_logprobs and logprobs_mode == "raw_logprobs":
        reported = torch.log_softmax(x[want_logprobs], dim=-1)
    elif want_logprobs and logprobs_mode == "raw_logits":
        reported = x[want_logprobs]  # a copy (advanced indexing)

    x = _process_logits(x, rows)
    if custom is not None:
        x = custom(x, False).to(torch.float32)

    greedy = [r.params.temperature < SAMPLING_EPS for r in rows]
    sampled = torch.empty(num_rows, dtype=torch.long, device=x.device)
    if any(greedy):
        sampled[:] = x.argmax(dim=-1)
    random_idx = [i for i in range(num_rows) if not greedy[i]]
    if random_idx:
        _scale_random_rows(x, rows, random_idx, custom)
        cap = x.shape[1] if max_top_k is None else min(max_top_k, x.shape[1])
        sampled[random_idx] = _sample_random(x[random_idx], [rows[i] for i in random_idx], cap, use_kernels)

    token_ids = sampled.tolist()
    logprobs: list[list[tuple[int, float, int]] | None] = [None] * num_rows
    if want_logprobs and reported is None:  # processed_*: x holds the edited logits
        cap = x.shape[1] if max_top_k is None else min(max_top_k, x.shape[1])
        reported = _processed_logits(x[want_logprobs], [rows[i] for i in want_logprobs], cap)
        if logprobs_mode == "processed_logprobs":
            reported = torch.log_softmax(reported, dim=-1)
    if want_logprobs:
        gathered = _gather_logprobs(reported, [token_ids[i] for i in want_logprobs],
                                    [rows[i].params.logprobs for i in want_logprobs])
        for i, entry in zip(want_logprobs, gathered):
            logprobs[i] = entry
    return HostSampleResult(token_ids=token_ids, logprobs=logprobs)
