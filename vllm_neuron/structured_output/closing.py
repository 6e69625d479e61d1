"""Closing a constrained output within its token budget.

A grammar says which text is valid, not how long it may be: a free JSON string, another array item
or another digit is always allowed, and a small model sampled at temperature 1 can keep choosing
them until max_tokens cuts the output short (a tool call that never parses). Bounding lengths in the
grammar (maxLength, maxItems) would forbid valid answers. Instead the budget closes it: while the
tokens left exceed what the shortest completion of the grammar needs, every token the grammar allows
stays allowed; once they do not (with a reserve, see `ClosingPlan`), only the next token of that
completion is, so the output ends valid with the stop token. What the grammar allows and still fits
in max_tokens is never forbidden; what would not fit was going to be cut anyway.

The shortest completion is found greedily, one character at a time, preferring characters that
close (`"`, `}`, `]`) over separators and digits and letters; on JSON that reaches the end (a string
closes at once, a number or array ends at the next closer, required keys are typed from their
finite names). Its tokens are the longest vocabulary entries that prefix it.
"""
from __future__ import annotations

import string
from typing import Any

# Closers first, then what moves through required structure (separators, a digit, literals' and
# keys' letters), then everything else printable.
_ORDER = '"}],:0' + "".join(c for c in string.digits[1:] + "-.eE" + string.ascii_lowercase
                              + string.ascii_uppercase + "_ " + string.punctuation + "\\" if c not in '"}],:')
_ORDER = "".join(dict.fromkeys(_ORDER))
# A completion longer than this is not searched for (a pathological regex); the output then runs as before.
MAX_COMPLETION_CHARS = 512
RESERVE_MARGIN = 8


def shortest_completion(matcher: Any, limit: int = MAX_COMPLETION_CHARS) -> str | None:
    """Text after which `matcher` (an xgrammar GrammarMatcher, not modified) may stop; None when the
    greedy search finds none within `limit` characters."""
    m = matcher.fork()
    out: list[str] = []
    while not m.is_completed():
        if len(out) >= limit:
            return None
        for c in _ORDER:
            if m.accept_string(c):  # a refused character leaves the matcher as it was
                out.append(c)
                break
        else:
            return None  # the grammar needs a character outside the printable ASCII tried here
    return "".join(out)


class TokenWriter:
    """Text -> the fewest tokens greedily: the longest vocabulary entry that prefixes the rest."""

    def __init__(self, decoded_vocab: list[bytes], special_token_ids: set[int]) -> None:
        self._ids: dict[bytes, int] = {}
        for i, b in enumerate(decoded_vocab):
            if b and i not in special_token_ids:
                self._ids.setdefault(b, i)
        self._max_len = max((len(b) for b in self._ids), default=1)

    def tokens(self, text: str) -> list[int] | None:
        data, out, i = text.encode("utf-8"), [], 0
        while i < len(data):
            for n in range(min(self._max_len, len(data) - i), 0, -1):
                t = self._ids.get(data[i:i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                return None  # a byte no token writes alone
        return out


class ClosingPlan:
    """Per request: when to close and which token to force.

    Forcing starts while the tokens left still cover the completion, the stop token and `reserve`:
    one sampled token may open new required structure (another array item, an optional property), about
    as much as the grammar's shortest complete output (its token count) plus RESERVE_MARGIN tokens.
    """

    def __init__(self, matcher: Any, writer: TokenWriter) -> None:
        self.writer = writer
        first = shortest_completion(matcher)
        toks = writer.tokens(first) if first is not None else None
        self.reserve = (len(toks) if toks is not None else 0) + RESERVE_MARGIN

    def forced_token(self, matcher: Any, tokens_left: int) -> int | None:
        """The one token to allow now, or None to allow the grammar's whole mask. -1: only a stop token."""
        # A completion has at most MAX_COMPLETION_CHARS tokens: no search while further from the end.
        if tokens_left > MAX_COMPLETION_CHARS + 1 + self.reserve:
            return None
        text = shortest_completion(matcher)
        toks = self.writer.tokens(text) if text is not None else None
        if toks is None:
            return None
        if tokens_left >= len(toks) + 1 + self.reserve:
            return None
        return toks[0] if toks else -1
