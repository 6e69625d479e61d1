"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of the
request's longest suffix n-gram (pure; numpy only).

For n from `max_n` down to `min_n`, the last n tokens are looked up among the earlier tokens; the
longest n that occurs wins, and among its occurrences the latest one (nearest context, which is what
repeated or edited text copies). The up to k tokens after that occurrence are the draft. No match: no
draft, so the step is a plain decode step and costs nothing extra. A match close to the end implies
a period; the draft then repeats it up to k tokens (as a copy with overlap does).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens for the continuation of `tokens` (may be fewer, or none)."""
    t = np.asarray(tokens, dtype=np.int64)
    n_tok = t.shape[0]
    if k <= 0 or n_tok < min_n + 1:
        return []
    max_n = min(max_n, n_tok - 1)
    # Candidate match ends e in [0, n_tok - 2] (a token must follow the match). match_len[e] counts how
    # many of the last tokens agree backwards from e, up to max_n.
    ends = np.arange(n_tok - 1)
    match_len = np.zeros(n_tok - 1, dtype=np.int64)
    alive = np.ones(n_tok - 1, dtype=bool)
    for j in range(max_n):
        idx = ends - j
        ok = alive & (idx >= 0)
        ok[ok] = t[idx[ok]] == t[n_tok - 1 - j]
        alive = ok
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return []
    e = int(np.flatnonzero(match_len == best)[-1])
    # Copy what followed the match; a copy that runs into the present continues from its own output
    # (the match says the text repeats with period n_tok - 1 - e).
    period = n_tok - 1 - e
    follow = t[e + 1:].tolist()
    return [follow[j % period] for j in range(k)]
