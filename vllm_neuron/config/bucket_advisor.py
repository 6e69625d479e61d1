"""Bucket advisor: the bucket lists that minimise the padding of the shapes an engine served (pure).

Seed 001's recommended approach to buckets (profile the prompt lengths, put buckets where the traffic is, drop
unused ones), automated. Input: `Traffic`, how often each step shape was served - prefill steps by their token
count, decode steps by (sequences, longest context) - and the engine's limits. Output: `Advice`, the three
neuron_config lists, each accepted by config/buckets.py's validators.

Cost model (compute-weighted): a prefill step of t tokens run in bucket T costs T; a decode step of b sequences
whose longest context is c, run in batch bucket B and context bucket C, costs B x C. Padding is the share of
that cost that no real token or sequence needed: 1 - sum(t) / sum(T), 1 - sum(b x c) / sum(B x C).

* Prefill tokens and decode batch sizes: the optimal 1-D k-partition. Over the sorted distinct values every
  bucket is the largest value of its group (a smaller one would not fit it, a larger one only costs more), so
  a dynamic programme over (buckets used, last value covered) is exact. The largest bucket is always the limit
  the validator requires (max_num_batched_tokens, max_num_seqs), served or not.
* Decode contexts: for fixed context buckets the batch list is that 1-D problem with weights count x C, and for
  fixed batch buckets the context list is the 1-D problem with weights count x B. Small cases enumerate every
  context list (exact); larger ones alternate the two exact steps from the best 1-D context list (each step can
  only lower the cost). Context buckets are multiples of lcm(128, block_size) below max_model_len, which is
  always the last one (config/buckets.py's rules).
* The graph budget: prefill graphs (x2 where prompts with cached context have a `_c` twin) plus decode graphs
  (batch buckets x context buckets; x2 with a speculator's verification graphs). It is split between the two
  kinds to minimise the expected step time, taking each kind's measured share of the busy time (equal shares
  when none was measured) and its time proportional to its cost.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from vllm_neuron.config import buckets as B

# Every context list is enumerated (exact) while a budget's context lists number at most this many.
EXACT_CONTEXT_LISTS = 400
MAX_ALTERNATIONS = 12
# The exact prefill programme runs over at most this many distinct values; past it values round up to a grid
# (each step's cost then moves by less than one grid step).
MAX_DISTINCT_VALUES = 1024


@dataclass(frozen=True)
class Limits:
    """The engine options the lists must fit, and how many graphs one bucket makes."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    prefill_graphs_per_bucket: int = 1  # 2 where prompts with cached context have a `_c{C}` twin
    decode_graphs_per_bucket: int = 1  # 2 with a speculator (a verification graph beside each decode graph)
    has_decode: bool = True  # False for a pooling engine (prefill graphs only)
    fixed_prefill: tuple[int, ...] | None = None  # kv_segment_size_buckets pins the prefill list

    @property
    def context_multiple(self) -> int:
        return math.lcm(B.CONTEXT_BUCKET_MULTIPLE, self.block_size)

    def context_top(self, context: int) -> int:
        """The smallest context bucket value that can hold `context` (the lists' grid, or max_model_len)."""
        m = self.context_multiple
        return min(-(-max(context, 1) // m) * m, self.max_model_len)


@dataclass
class Traffic:
    """Step shapes served and how often: prefill {tokens: steps}, decode {(sequences, longest context): steps};
    seconds: busy time by step kind ("prefill", "decode") where measured."""

    prefill: dict[int, float] = field(default_factory=dict)
    decode: dict[tuple[int, int], float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    # sum(steps x sequences x longest context) where `decode` holds contexts already rounded up to the lists'
    # grid (a summary's); None: `decode`'s contexts are the real ones.
    decode_work: float | None = None

    @property
    def steps(self) -> float:
        return sum(self.prefill.values()) + sum(self.decode.values())

    def decode_real(self) -> float:
        """sum(steps x sequences x longest context): the decode work that was not padding."""
        if self.decode_work is not None:
            return self.decode_work
        return sum(n * b * c for (b, c), n in self.decode.items())

    def check(self, limits: Limits) -> None:
        """ValueError naming the first observation the limits cannot hold (data from another configuration)."""
        for t, n in self.prefill.items():
            if not 0 < t <= limits.max_num_batched_tokens or n < 0:
                raise ValueError(f"prefill step of {t} tokens (x{n}) does not fit max_num_batched_tokens="
                                 f"{limits.max_num_batched_tokens}: the data come from another configuration")
        for (b, c), n in self.decode.items():
            if not 0 < b <= limits.max_num_seqs or not 0 < c <= limits.max_model_len or n < 0:
                raise ValueError(f"decode step of {b} sequences, context {c} (x{n}) does not fit max_num_seqs="
                                 f"{limits.max_num_seqs} / max_model_len={limits.max_model_len}: the data come "
                                 "from another configuration")


@dataclass(frozen=True)
class Lists:
    """Bucket lists as neuron_config takes them; contexts holds max_model_len last (the graphs' contexts)."""

    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    contexts: tuple[int, ...]

    def graphs(self, limits: Limits) -> int:
        decode = len(self.decode) * len(self.contexts) * limits.decode_graphs_per_bucket if limits.has_decode else 0
        return len(self.prefill) * limits.prefill_graphs_per_bucket + decode

    def neuron_config(self) -> dict[str, object]:
        """The three neuron_config keys (decode_context_length_buckets null: max_model_len only)."""
        return {"num_batched_tokens_buckets": list(self.prefill), "num_seqs_buckets": list(self.decode),
                "decode_context_length_buckets": list(self.contexts[:-1]) or None}


@dataclass(frozen=True)
class Evaluation:
    prefill_padding: float  # share of the prefill cost that is padding (0 when nothing was served)
    decode_padding: float
    expected_time: float  # busy time relative to the current lists' (1.0), each kind's time share as measured
    graphs: int


@dataclass(frozen=True)
class Advice:
    current: Lists
    proposed: Lists
    before: Evaluation
    after: Evaluation
    budget: int


# -- the 1-D problem --------------------------------------------------------------------------------------------

def _points(values: Mapping[int, float], top: int, grid: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(ascending distinct candidate tops ending at `top`, their weights); values above `top` are refused by
    Traffic.check, values round up to `grid`."""
    acc: dict[int, float] = {}
    for v, w in values.items():
        p = min(-(-v // grid) * grid, top)
        acc[p] = acc.get(p, 0.0) + w
    acc.setdefault(top, 0.0)
    pts = sorted(acc)
    return np.array(pts, dtype=np.float64), np.array([acc[p] for p in pts], dtype=np.float64)


def partition_costs(values: Mapping[int, float], top: int, k: int) -> list[tuple[float, list[int]]]:
    """For m = 1..k buckets: (smallest sum(weight x bucket(value)), its ascending bucket list ending at `top`),
    where bucket(v) is the list's smallest element >= v. Exact (see the module docstring). values: value ->
    weight, each value in 1..top."""
    if k < 1:
        raise ValueError(f"the number of buckets must be >= 1, got {k}")
    pts, w = _points(values, top)
    if len(pts) > MAX_DISTINCT_VALUES:
        pts, w = _points(values, top, -(-top // MAX_DISTINCT_VALUES))
    n = len(pts)
    cum = np.cumsum(w)  # cum[j]: weight of points 0..j
    # step[j, i]: the cost of one bucket at point j covering points i+1..j (i < j); inf where i >= j.
    step = pts[:, None] * (cum[:, None] - cum[None, :])
    step[np.triu_indices(n)] = np.inf
    f = pts * cum  # one bucket ending at point j covers points 0..j
    back: list[np.ndarray] = []
    out = [(float(f[-1]), [int(pts[-1])])]
    rows = np.arange(n)
    for _ in range(2, min(k, n) + 1):
        total = step + f[None, :]
        arg = np.argmin(total, axis=1)
        f = total[rows, arg]
        f[0] = np.inf  # point 0 cannot end a second bucket
        back.append(arg)
        tops, j = [int(pts[-1])], n - 1
        for level in range(len(back) - 1, -1, -1):
            j = int(back[level][j])
            tops.append(int(pts[j]))
        out.append((float(f[-1]), tops[::-1]))
    while len(out) < k:  # more buckets than distinct values: the last list stays optimal
        out.append(out[-1])
    return out


def bucket_cost(buckets: Sequence[int], values: Mapping[int, float]) -> float:
    """sum(weight x bucket(value)) for a given ascending list (values above its last are refused)."""
    return sum(w * B.select_bucket(buckets, v) for v, w in values.items())


# -- decode: batch x context ------------------------------------------------------------------------------------

def _decode_cost(batch: Sequence[int], contexts: Sequence[int], decode: Mapping[tuple[int, int], float]) -> float:
    return sum(n * B.select_bucket(batch, b) * B.select_bucket(contexts, c) for (b, c), n in decode.items())


def _batch_weights(decode, contexts: Sequence[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for (b, c), n in decode.items():
        out[b] = out.get(b, 0.0) + n * B.select_bucket(contexts, c)
    return out


def _context_weights(decode, batch: Sequence[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for (b, c), n in decode.items():
        out[c] = out.get(c, 0.0) + n * B.select_bucket(batch, b)
    return out


def _best_contexts(decode, limits: Limits, kc: int, kb: int) -> tuple[int, ...]:
    """A context list of at most kc buckets (ending at max_model_len) for kb batch buckets; `decode`'s contexts
    lie on the lists' grid (normalized)."""
    top = limits.max_model_len
    seen = sorted({c for _, c in decode} - {top})
    if kc == 1 or not seen:
        return (top,)
    lists = sum(math.comb(len(seen), r) for r in range(1, kc))
    if lists <= EXACT_CONTEXT_LISTS:
        best, best_cost = (top,), math.inf
        for r in range(0, kc):
            for combo in itertools.combinations(seen, r):
                ctx = (*combo, top)
                cost = partition_costs(_batch_weights(decode, ctx), limits.max_num_seqs, kb)[-1][0]
                if cost < best_cost:
                    best, best_cost = ctx, cost
        return best
    ctx = tuple(partition_costs(_context_weights(decode, [limits.max_num_seqs]), top, kc)[-1][1])
    cost = math.inf
    for _ in range(MAX_ALTERNATIONS):
        batch = partition_costs(_batch_weights(decode, ctx), limits.max_num_seqs, kb)[-1][1]
        new_cost, new_ctx = partition_costs(_context_weights(decode, batch), top, kc)[-1]
        if new_cost >= cost:
            break
        cost, ctx = new_cost, tuple(new_ctx)
    return ctx


def on_context_grid(decode: Mapping[tuple[int, int], float], limits: Limits) -> dict[tuple[int, int], float]:
    """decode steps with each context rounded up to the smallest value a context bucket may take (a valid list
    puts both in the same bucket, so no cost changes)."""
    out: dict[tuple[int, int], float] = {}
    for (b, c), n in decode.items():
        key = (b, limits.context_top(c))
        out[key] = out.get(key, 0.0) + n
    return out


def decode_options(decode: Mapping[tuple[int, int], float], limits: Limits,
                   max_graphs: int) -> dict[int, tuple[float, tuple[int, ...], tuple[int, ...]]]:
    """Decode graphs used -> (cost, batch list, context list): the cheapest lists found for each graph count up
    to max_graphs (counts no pair of lists makes are absent)."""
    decode = on_context_grid(decode, limits)
    per = limits.decode_graphs_per_bucket
    distinct = len({c for _, c in decode} | {limits.max_model_len})
    out: dict[int, tuple[float, tuple[int, ...], tuple[int, ...]]] = {}
    for kc in range(1, min(distinct, max_graphs // per) + 1):
        kb_max = max_graphs // (kc * per)
        ctx = _best_contexts(decode, limits, kc, kb_max)
        for cost, batch in partition_costs(_batch_weights(decode, ctx), limits.max_num_seqs, kb_max):
            graphs = len(batch) * len(ctx) * per
            if graphs not in out or cost < out[graphs][0]:
                out[graphs] = (cost, tuple(batch), ctx)
    return out


# -- the whole proposal -----------------------------------------------------------------------------------------

def _padding(real: float, cost: float) -> float:
    return 0.0 if cost <= 0 else max(0.0, 1.0 - real / cost)


def _costs(lists: Lists, traffic: Traffic) -> tuple[float, float]:
    p = bucket_cost(lists.prefill, traffic.prefill)
    d = _decode_cost(lists.decode, lists.contexts, traffic.decode) if traffic.decode else 0.0
    return p, d


def _time_weights(traffic: Traffic, p_cost: float, d_cost: float) -> tuple[float, float]:
    """Seconds per unit of cost of each kind: its measured busy time (or, unmeasured, an equal share of one
    second) over its cost at the current lists."""
    tp, td = traffic.seconds.get("prefill", 0.0), traffic.seconds.get("decode", 0.0)
    if (tp <= 0 and p_cost > 0) or (td <= 0 and d_cost > 0):
        tp, td = float(p_cost > 0), float(d_cost > 0)
    total = (tp + td) or 1.0
    return (tp / total / p_cost if p_cost > 0 else 0.0), (td / total / d_cost if d_cost > 0 else 0.0)


def evaluate(lists: Lists, traffic: Traffic, limits: Limits, weights: tuple[float, float]) -> Evaluation:
    """Padding of each kind, expected time (seconds-per-cost `weights`) and graphs of `lists` on `traffic`."""
    p_real = sum(n * t for t, n in traffic.prefill.items())
    d_real = traffic.decode_real()
    p_cost, d_cost = _costs(lists, traffic)
    return Evaluation(_padding(p_real, p_cost), _padding(d_real, d_cost),
                      weights[0] * p_cost + weights[1] * d_cost, lists.graphs(limits))


def minimum_graphs(limits: Limits) -> int:
    p = len(limits.fixed_prefill) if limits.fixed_prefill is not None else 1
    return p * limits.prefill_graphs_per_bucket + (limits.decode_graphs_per_bucket if limits.has_decode else 0)


def advise(traffic: Traffic, limits: Limits, current: Lists, max_graphs: int | None = None) -> Advice:
    """The lists with the smallest expected step time under `max_graphs` graphs (default: as many as the
    current lists make). ValueError: no traffic, traffic the limits cannot hold, or a budget below the
    minimum (one prefill graph and one decode graph)."""
    if traffic.steps <= 0:
        raise ValueError("no steps were recorded: serve some traffic first (nothing to advise on)")
    traffic.check(limits)
    budget = current.graphs(limits) if max_graphs is None else max_graphs
    minimum = minimum_graphs(limits)
    if budget < minimum:
        raise ValueError(f"--max-graphs {budget} is below this engine's minimum of {minimum} graphs (one prefill "
                         f"and one decode bucket{', the prefill list kv_segment_size_buckets pins' if limits.fixed_prefill else ''})")
    weights = _time_weights(traffic, *_costs(current, traffic))
    per_p = limits.prefill_graphs_per_bucket
    if limits.fixed_prefill is not None:
        fixed = tuple(limits.fixed_prefill)
        prefill_opts = {len(fixed) * per_p: (bucket_cost(fixed, traffic.prefill), fixed)}
    else:
        prefill_opts = {}
        k_max = (budget - minimum) // per_p + 1
        for cost, tops in partition_costs(traffic.prefill, limits.max_num_batched_tokens, k_max):
            prefill_opts.setdefault(len(tops) * per_p, (cost, tuple(tops)))
    if limits.has_decode and traffic.decode:
        decode_opts = decode_options(traffic.decode, limits, budget - min(prefill_opts))
    elif limits.has_decode:  # no decode step served: the smallest lists
        decode_opts = {limits.decode_graphs_per_bucket: (0.0, (limits.max_num_seqs,), (limits.max_model_len,))}
    else:
        decode_opts = {0: (0.0, current.decode, current.contexts)}
    best = None
    for pg, (pc, plist) in prefill_opts.items():
        for dg, (dc, blist, clist) in decode_opts.items():
            if pg + dg <= budget:
                key = (round(weights[0] * pc + weights[1] * dc, 9), pg + dg)  # ties: fewer graphs
                if best is None or key < best[0]:
                    best = (key, Lists(plist, blist, clist))
    proposed = best[1]
    return Advice(current, proposed, evaluate(current, traffic, limits, weights),
                  evaluate(proposed, traffic, limits, weights), budget)


def quick_padding(traffic: Traffic, limits: Limits, current: Lists) -> tuple[tuple[float, float], tuple[float, float]]:
    """((prefill, decode) padding of the current lists, (prefill, decode) padding of the advised lists with as
    many buckets of each kind, the context list kept): the cheap check behind the engine's hint."""
    p_real = sum(n * t for t, n in traffic.prefill.items())
    d_real = traffic.decode_real()
    p_now, d_now = _costs(current, traffic)
    p_new, d_new = p_now, d_now
    if traffic.prefill and limits.fixed_prefill is None:
        p_new = partition_costs(traffic.prefill, limits.max_num_batched_tokens, len(current.prefill))[-1][0]
    if traffic.decode:
        d_new = partition_costs(_batch_weights(traffic.decode, current.contexts), limits.max_num_seqs,
                                len(current.decode))[-1][0]
    return ((_padding(p_real, p_now), _padding(d_real, d_now)),
            (_padding(p_real, p_new), _padding(d_real, d_new)))


def validate_lists(lists: Lists, limits: Limits) -> None:
    """config/buckets.py's checks of the three lists (ValueError naming the option)."""
    B.validate_prefill_buckets(list(lists.prefill), limits.max_num_batched_tokens)
    B.validate_decode_buckets(list(lists.decode), limits.max_num_seqs)
    B.validate_context_buckets(lists.neuron_config()["decode_context_length_buckets"], limits.max_model_len,
                               limits.block_size)
    if lists.contexts[-1] != limits.max_model_len:
        raise ValueError(f"the last context bucket must be max_model_len={limits.max_model_len}, "
                         f"got {list(lists.contexts)}")
