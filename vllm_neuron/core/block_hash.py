"""Chained block hashes for prefix caching (pure).

A block's hash covers its parent's hash, its tokens and any extra keys, so equal hashes mean an equal
whole prefix. sha256 keeps hashes stable across processes and machines (disaggregated prefill moves
blocks between engines).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def hash_block(parent: bytes | None, tokens: Sequence[int], extra_keys: tuple = ()) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], num_tokens: int, block_size: int, extra_keys: tuple = ()
) -> list[bytes]:
    """Appends hashes for the full blocks among the first `num_tokens` tokens not yet hashed."""
    full = num_tokens // block_size
    for i in range(len(hashes), full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys))
    return hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()) -> list[bytes]:
    return extend_block_hashes([], token_ids, len(token_ids), block_size, extra_keys)
