"""Bucket lists: defaults, validation, smallest-fit selection and graph names.

Pure functions shared by the scheduler (which must not schedule more than the largest bucket)
and the model runner (which compiles one graph per bucket and pads each step to one).

Validation is strict, as in vLLM Neuron: a list must already be strictly ascending; it is
never sorted or de-duplicated behind the user's back, because a misordered list usually means
a typo in a launch script. Every error names the option, the list and the limit.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from vllm_neuron.config import validate as V

MIN_DEFAULT_PREFILL_BUCKET = 128
CONTEXT_BUCKET_MULTIPLE = 128
KV_SEGMENT_SIZES = (512, 1024, 2048, 4096, 8192)


def _powers_of_two_up_to(start: int, maximum: int, factor: int = 2) -> list[int]:
    out = []
    size = start
    while size < maximum:
        out.append(size)
        size *= factor
    out.append(maximum)
    return out


def default_prefill_buckets(max_num_batched_tokens: int, start: int = MIN_DEFAULT_PREFILL_BUCKET) -> list[int]:
    """Powers of two from `start` (the seeds' 128) up to max_num_batched_tokens, the maximum itself
    included (it need not be a power of two). A maximum below `start` gives [max_num_batched_tokens]."""
    V.integer("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
    if max_num_batched_tokens < start:
        return [max_num_batched_tokens]
    return _powers_of_two_up_to(start, max_num_batched_tokens)


def default_decode_buckets(max_num_seqs: int, factor: int = 2) -> list[int]:
    """Powers of two (the seeds' default; `factor` 4 gives powers of four) from 1 up to max_num_seqs,
    the maximum itself included."""
    V.integer("max_num_seqs", max_num_seqs, minimum=1)
    return _powers_of_two_up_to(1, max_num_seqs, factor)


def validate_bucket_list(option: str, buckets: object) -> list[int]:
    """A non-empty, strictly ascending list of positive ints; ValueError naming `option`."""
    if not isinstance(buckets, (list, tuple)) or len(buckets) == 0:
        raise ValueError(f"{option} must be a non-empty list of positive integers, got {buckets!r}")
    for value in buckets:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"{option}={list(buckets)!r} is invalid: every bucket must be a positive "
                f"integer, got {value!r}"
            )
    for prev, cur in zip(buckets, buckets[1:]):
        if cur <= prev:
            raise ValueError(
                f"{option}={list(buckets)!r} is invalid: buckets must be strictly ascending "
                f"({prev} is followed by {cur}); sort the list and remove duplicates"
            )
    return list(buckets)


def _check_largest(option: str, buckets: list[int], limit_name: str, limit: int) -> None:
    if buckets[-1] != limit:
        raise ValueError(
            f"{option}={buckets!r} is invalid: the largest bucket ({buckets[-1]}) must equal "
            f"{limit_name}={limit}"
        )


def validate_prefill_buckets(buckets: Sequence[int], max_num_batched_tokens: int) -> list[int]:
    """Check num_batched_tokens_buckets: positive, strictly ascending, largest equal to
    max_num_batched_tokens. Returns the list."""
    V.integer("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
    out = validate_bucket_list("num_batched_tokens_buckets", buckets)
    _check_largest("num_batched_tokens_buckets", out, "max_num_batched_tokens", max_num_batched_tokens)
    return out


def validate_decode_buckets(buckets: Sequence[int], max_num_seqs: int) -> list[int]:
    """Check num_seqs_buckets: positive, strictly ascending, largest equal to max_num_seqs.
    Returns the list."""
    V.integer("max_num_seqs", max_num_seqs, minimum=1)
    out = validate_bucket_list("num_seqs_buckets", buckets)
    _check_largest("num_seqs_buckets", out, "max_num_seqs", max_num_seqs)
    return out


def validate_context_buckets(
    buckets: Sequence[int] | None, max_model_len: int, block_size: int
) -> list[int] | None:
    """Check decode_context_length_buckets (None means disabled and is returned as is).

    Seeds' rules: ascending, each < max_model_len, each divisible by 128. Each must also be a
    whole number of KV blocks (divisible by block_size), since a context bucket fixes how
    many blocks a decode graph gathers per sequence.
    """
    V.integer("max_model_len", max_model_len, minimum=1)
    V.integer("block_size", block_size, minimum=1)
    if buckets is None:
        return None
    option = "decode_context_length_buckets"
    out = validate_bucket_list(option, buckets)
    for value in out:
        if value >= max_model_len:
            raise ValueError(
                f"{option}={out!r} is invalid: every bucket must be < max_model_len="
                f"{max_model_len} (max_model_len is always added as the largest context), "
                f"got {value}"
            )
        if value % CONTEXT_BUCKET_MULTIPLE:
            raise ValueError(
                f"{option}={out!r} is invalid: every bucket must be divisible by "
                f"{CONTEXT_BUCKET_MULTIPLE}, got {value}"
            )
        if value % block_size:
            raise ValueError(
                f"{option}={out!r} is invalid: every bucket must be divisible by "
                f"block_size={block_size}, got {value}"
            )
    return out


def context_buckets(decode_context_length_buckets: Sequence[int] | None, max_model_len: int) -> list[int]:
    """The decode context lengths to compile: the given list plus max_model_len (the largest
    context is always available, so every request can decode), or [max_model_len]."""
    if not decode_context_length_buckets:
        return [max_model_len]
    return [*decode_context_length_buckets, max_model_len]


def validate_kv_segment_buckets(
    kv_segment_size_buckets: Sequence[int] | None,
    num_batched_tokens_buckets: Sequence[int],
    block_size: int,
) -> list[int] | None:
    """Check kv_segment_size_buckets (None means disabled and is returned as is).

    Seeds' rules: values in {512, 1024, 2048, 4096, 8192}, divisible by block_size, only a
    single segment size supported at this time, and identical to num_batched_tokens_buckets
    (kernel constraint).
    """
    V.integer("block_size", block_size, minimum=1)
    if kv_segment_size_buckets is None:
        return None
    option = "kv_segment_size_buckets"
    out = validate_bucket_list(option, kv_segment_size_buckets)
    valid = ", ".join(str(s) for s in KV_SEGMENT_SIZES)
    for value in out:
        if value not in KV_SEGMENT_SIZES:
            raise ValueError(f"{option}={out!r} is invalid: values must be in {{{valid}}}, got {value}")
        if value % block_size:
            raise ValueError(
                f"{option}={out!r} is invalid: every segment size must be divisible by "
                f"block_size={block_size}, got {value}"
            )
    if len(out) != 1:
        raise ValueError(
            f"{option}={out!r} is invalid: only a single segment size is supported at this time"
        )
    if list(num_batched_tokens_buckets) != out:
        raise ValueError(
            f"{option}={out!r} and num_batched_tokens_buckets={list(num_batched_tokens_buckets)!r} "
            "must currently be identical (kernel constraint)"
        )
    return out


def select_bucket(buckets: Sequence[int], n: int) -> int:
    """Smallest bucket >= n (buckets ascending). ValueError when n exceeds the largest."""
    if not buckets:
        raise ValueError("select_bucket: the bucket list is empty")
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"Request exceeds largest bucket: n={n} > {buckets[-1]}")
    return buckets[i]


_KINDS = ("prefill", "decode")


def bucket_name(kind: str, size: int, context: int | None = None) -> str:
    """Graph / metric label of a bucket: prefill_s{T}, prefill_s{T}_c{C}, decode_b{B},
    decode_b{B}_c{C}."""
    if kind not in _KINDS:
        raise ValueError(f"bucket kind {kind!r} is not valid; valid values: {', '.join(_KINDS)}")
    base = f"prefill_s{size}" if kind == "prefill" else f"decode_b{size}"
    return base if context is None else f"{base}_c{context}"


def bucket_names(prefill: Sequence[int], decode: Sequence[int], contexts: Sequence[int],
                 prefill_with_context: bool = False) -> list[str]:
    """Names of every graph compiled for these lists: one prefill graph per token bucket (plus, when
    prompts can start from cached context, a `_c{C}` twin for the largest context C); one decode graph
    per batch bucket, times each context bucket when there is more than one context (a single context -
    max_model_len - keeps the plain decode_b{B} name)."""
    names = []
    for t in prefill:
        names.append(bucket_name("prefill", t))
        if prefill_with_context:
            names.append(bucket_name("prefill", t, contexts[-1]))
    for b in decode:
        if len(contexts) > 1:
            names.extend(bucket_name("decode", b, c) for c in contexts)
        else:
            names.append(bucket_name("decode", b))
    return names


def parse_bucket_name(name: str) -> tuple[str, int, int]:
    """(kind, size, context or 0) of a name made by bucket_name()."""
    kind, rest = name.split("_", 1)
    parts = rest.split("_c")
    return kind, int(parts[0][1:]), int(parts[1]) if len(parts) > 1 else 0


def format_bucket_table(prefill: Sequence[int], decode: Sequence[int], contexts: Sequence[int],
                        prefill_with_context: bool = False) -> str:
    """Multi-line table of the bucket lists and the graphs, for the start-up log."""
    names = bucket_names(prefill, decode, contexts, prefill_with_context)
    rows = [
        ("prefill tokens (num_batched_tokens_buckets)", prefill),
        ("decode sequences (num_seqs_buckets)", decode),
        ("decode context lengths", contexts),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"Buckets: {len(names)} graphs"]
    lines += [f"  {label:<{width}} : {', '.join(str(v) for v in values)}" for label, values in rows]
    lines.append(f"  {'graphs':<{width}} : {', '.join(names)}")
    return "\n".join(lines)
