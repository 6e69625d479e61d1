"""The seeded sampler: greedy, temperature, top-k, top-p, per row; in the graph and on the host.

One definition of random sampling for every path a request can take, so that a seeded request's
tokens do not depend on which path sampled them (in-graph on Model Runner V1 or V2, or the host
sampler when logprobs, a penalty or any other host-only option is set, or after preemption):
* the random number of a row is `counter_uniform(seed, position)`: a pure function of the request's
  32-bit seed and the position of the token being sampled (no generator state to drift);
* the kept set is a logit threshold: top-k keeps the k best tokens (ties with the k-th included),
  top-p the smallest prefix of them, most likely first, whose probability reaches top_p (over the
  top-k tokens when top_k is set, else over the whole vocabulary); with top_k off, top-p looks at
  no more than `max_top_k` tokens (neuron_config.on_device_sampling_config.top_k, 256 by default),
  on every path alike; with neither set the whole vocabulary is kept;
* the token is the inverse CDF of the kept probabilities, in token-id order, at that number.
Static shapes only (no `.item()`, no Python branch on tensor values): it runs inside the compiled
graph of every bucket. A batch whose rows are all greedy skips the top-k, top-p and CDF work
(`torch.cond`, a real branch in the compiled graph; outside a compiled graph - the host sampler, eager
execution - a plain Python branch, because an eager `torch.cond` costs ~2 ms a call).
On CPU with the custom kernels (the engine's KernelConfig.sampler) the whole of `sample_in_graph` is one op,
`vllm_neuron::sample_rows` (kernels/sampler.cpp: the same algorithm row by row), in the graphs and on the host
alike (`sample_slots`: MRv2's form): inductor's code for it was two of a decode graph's 8 kernels.
"""
from __future__ import annotations

import torch

# Below this temperature a row is greedy (same threshold as SamplingParams).
_GREEDY_EPS = 1e-5
# The seeds: "When top_k is set to -1, it is internally limited to 256" (here: top-p's search width).
DEFAULT_MAX_TOP_K = 256

_M32 = 0xFFFFFFFF
# Multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows.
_MUL_A = 0x7FEB352D
_MUL_B = 0x6A09E667
_POS_SALT = 0x5BD1E995


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanching 32-bit integer mix; x holds values in [0, 2**32) as int64."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _M32
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[N] float32 in [0, 1) from int64 seeds in [0, 2**32) and positions (counter-based: the same
    (seed, position) always gives the same number, on any device, in or out of a graph)."""
    h = _mix32((seed & _M32) ^ _mix32((position & _M32) ^ _POS_SALT))
    # 24 bits: exactly representable in float32, so the result is strictly below 1.
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def fold_seed(seed: int) -> int:
    """A request's integer seed (any size or sign) folded to the 32 bits `counter_uniform` hashes."""
    s = seed % (1 << 64)
    return (s ^ (s >> 32)) & _M32


def _cpu_kernels(logits: torch.Tensor, use_kernels: bool) -> bool:
    return use_kernels and logits.device.type == "cpu"


def greedy_in_graph(logits: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
    """[B, V] -> [B] int64 argmax (torch.argmax's: the first largest, a NaN above all), for all-greedy
    configurations; on the logits' own dtype (widening to fp32 changes no order). `use_kernels` (the engine's
    KernelConfig.sampler): CPU logits take the argmax kernel (kernels/sampler.cpp)."""
    if _cpu_kernels(logits, use_kernels) and logits.dtype in (torch.bfloat16, torch.float32):  # fp16: no vector path
        return torch.ops.vllm_neuron.greedy_argmax(logits)
    return torch.argmax(logits, dim=-1)


def _kept_set(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              max_top_k: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits / temperature, their logsumexp, the kept tokens [B, V] bool) of each row."""
    vocab = logits.shape[-1]
    k = min(width, vocab)  # a Python int: shapes are static per compiled graph
    is_greedy = temperature < _GREEDY_EPS
    safe_temp = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    scaled = logits / safe_temp.unsqueeze(1)
    lse_all = torch.logsumexp(scaled, dim=-1, keepdim=True)

    # The kept set as a threshold on the scaled logits, found on the k best tokens.
    top_vals = torch.topk(scaled, k, dim=-1).values
    positions = torch.arange(k, device=logits.device).unsqueeze(0)
    k_off = torch.full_like(top_k, min(max_top_k, k))
    k_eff = torch.where(top_k <= 0, k_off, top_k.clamp(max=k))
    in_k = positions < k_eff.unsqueeze(1)
    masked = top_vals.masked_fill(~in_k, float("-inf"))
    norm = torch.where((top_k > 0).unsqueeze(1), torch.logsumexp(masked, dim=-1, keepdim=True), lse_all)
    probs_sorted = torch.exp(masked - norm)
    # A token stays if the mass before it is below top_p; the first always stays, and top_p = 1
    # keeps all (rounding must not drop the tail).
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    keep = in_k & ((mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1) | (positions == 0))
    last_kept = (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    threshold = top_vals.gather(1, last_kept)
    truncating = ((top_k > 0) | (top_p < 1.0)).unsqueeze(1)
    threshold = torch.where(truncating, threshold, torch.full_like(threshold, float("-inf")))
    return scaled, lse_all, scaled >= threshold


def truncated_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     max_top_k: int = DEFAULT_MAX_TOP_K) -> torch.Tensor:
    """The logits a row samples from: divided by its temperature, -inf outside its top-k / top-p set
    (vLLM's processed logits); greedy rows unchanged."""
    scaled, _, kept = _kept_set(logits, temperature, top_k, top_p, max_top_k, logits.shape[-1])
    return torch.where((temperature < _GREEDY_EPS).unsqueeze(1), logits, scaled.masked_fill(~kept, float("-inf")))


def _sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 uniform: torch.Tensor, max_top_k: int, width: int) -> torch.Tensor:
    vocab = logits.shape[-1]
    is_greedy = temperature < _GREEDY_EPS
    scaled, lse_all, kept = _kept_set(logits, temperature, top_k, top_p, max_top_k, width)

    # Inverse CDF over the kept probabilities in token-id order (no sort of the vocabulary).
    probs = torch.exp(scaled - lse_all) * kept
    cdf = torch.cumsum(probs, dim=-1)
    target = uniform.to(torch.float32).unsqueeze(1) * cdf[:, -1:]
    choice = (cdf <= target).sum(dim=-1)
    # Rounding at the top end must not step past the last kept token.
    ids = torch.arange(vocab, device=logits.device)
    last_id = torch.where(kept & (probs > 0), ids, torch.zeros_like(ids)).amax(dim=-1)
    sampled = torch.minimum(choice, last_id)
    return torch.where(is_greedy, torch.argmax(logits, dim=-1), sampled)


def filtered_top_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, max_top_k: int = DEFAULT_MAX_TOP_K
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-decoding rejection sampler's distribution, in top-k space (top_k off is capped at
    max_top_k here): (probs [B, k] unnormalized over the
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


def _branch(pred: torch.Tensor, true_fn, false_fn, operands: tuple) -> torch.Tensor:
    """torch.cond while dynamo traces; eagerly, the branch the predicate picks (same result, without the
    ~2 ms per call of running torch.cond outside a graph)."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_fn, false_fn, operands)
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


def sample_in_graph(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, uniform: torch.Tensor,
                    max_top_k: int = DEFAULT_MAX_TOP_K, width: int | None = None,
                    use_kernels: bool = False) -> torch.Tensor:
    """Samples one token per row (the module docstring says how).

    logits [B, V]; temperature [B] f32 (0 = greedy); top_k [B] int64 (<= 0: off); top_p [B] f32 in
    (0, 1]; uniform [B] f32 in [0, 1) (`counter_uniform`). max_top_k caps top-p's tokens when top_k
    is off; width (default max_top_k) is how many tokens the threshold search looks at, at least the
    largest top_k of the batch; use_kernels (the engine's KernelConfig.sampler): CPU logits take the
    `sample_rows` kernel for every row. Returns [B] int64 token ids.
    """
    width = max_top_k if width is None else width
    if _cpu_kernels(logits, use_kernels) and logits.dtype in (torch.bfloat16, torch.float32):
        return torch.ops.vllm_neuron.sample_rows(logits, temperature, top_k, top_p, uniform, max_top_k, width)
    all_greedy = (temperature < _GREEDY_EPS).all()
    # Only the sampling side widens to fp32 (the argmax is the same on the model's dtype).
    return _branch(all_greedy, lambda lg, t, k, p, u: greedy_in_graph(lg, use_kernels),
                   lambda lg, t, k, p, u: _sample_rows(lg.to(torch.float32), t, k, p, u, max_top_k, width),
                   (logits, temperature, top_k, top_p, uniform))


def sample_slots(logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
                 top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor, max_top_k: int = DEFAULT_MAX_TOP_K,
                 use_kernels: bool = False) -> torch.Tensor:
    """`sample_in_graph` for rows whose parameters live in per-slot tensors (Model Runner V2's state): row i
    samples with slot slots[i]'s temperature, top_k, top_p and the number counter_uniform(seed[slot],
    positions[i]). With `use_kernels` on CPU logits one op does the gathers, the hash and the draw."""
    if _cpu_kernels(logits, use_kernels) and logits.dtype in (torch.bfloat16, torch.float32):
        return torch.ops.vllm_neuron.sample_slots(logits, slots, positions, temperature, top_k, top_p, seed,
                                                  max_top_k, max_top_k)
    return sample_in_graph(logits, temperature[slots], top_k[slots], top_p[slots],
                           counter_uniform(seed[slots], positions), max_top_k, use_kernels=use_kernels)


def _masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    idx = torch.arange(vocab, device=logits.device)
    words = bitmask[:, idx >> 5]
    allowed = ((words >> (idx & 31)) & 1).bool()
    return logits.masked_fill(~allowed, float("-inf"))


def _unmasked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    return logits.clone()  # a cond branch may not return its input


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
    """Masks disallowed tokens to -inf. bitmask [B, ceil(V / 32)] int32, bit j of word w allows token
    32 * w + j (xgrammar's layout); an all-ones row (-1 words) allows everything. Static shapes.
    With `use_kernels` (the engine's KernelConfig.sampler) on CPU logits the mask goes into `logits` IN PLACE
    (callers pass a tensor of their own, the graphs' fresh logits), touching only words that forbid something.
    Elsewhere a batch without constraints (every word -1) branches past the per-token unpack (`torch.cond`, whose untaken side must copy): the unpack was
    ~0.8 ms of every ~20 ms decode_b16 step of the bundled model (16 rows x 49,152 tokens; AMD EPYC, 2 cores)."""
    if (_cpu_kernels(logits, use_kernels) and logits.is_contiguous() and bitmask.is_contiguous()
            and bitmask.dtype == torch.int32):
        torch.ops.vllm_neuron.apply_token_bitmask_(logits, bitmask)
        return logits
    return _branch((bitmask != -1).any(), _masked, _unmasked, (logits, bitmask))
