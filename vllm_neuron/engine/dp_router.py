"""Which data-parallel replica serves a request: least outstanding work, with prefix affinity (pure).

Each replica has its own KV cache, so a prompt whose first blocks another request already sent to
replica r is cheapest on r (its prefix-cache hit skips that prefill). The router remembers which
replica each prompt block went to, keyed by the same chained block hashes the scheduler's prefix
cache uses (core/block_hash.py), so "shares the first k blocks" is an exact test. Affinity gives way
to load when the preferred replica has `imbalance` more requests in flight than the least loaded one:
a popular system prompt must not pin every request to one replica.

Nothing here knows about processes or sockets; `choose_replica` is a pure function and
`DPRouter` only keeps the bookkeeping it needs (loads, a bounded block -> replica table).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_neuron.core.block_hash import prompt_block_hashes


@dataclass(frozen=True)
class RouteDecision:
    replica: int
    matched_blocks: int  # prompt blocks already sent to that replica (0: routed by load only)
    reason: str  # "prefix" or "load"


def choose_replica(loads: Sequence[int], alive: Sequence[bool], affinity: int | None,
                   matched_blocks: int, imbalance: int) -> RouteDecision:
    """loads[r]: requests in flight on replica r; alive[r]: it can take requests; affinity: the replica
    holding the longest known prefix of this prompt (`matched_blocks` blocks of it), or None.
    The affinity replica wins unless it is dead or its load exceeds the least load by more than
    `imbalance`; otherwise the least loaded live replica, lowest rank on ties.
    Raises RuntimeError when no replica is alive."""
    live = [r for r in range(len(loads)) if alive[r]]
    if not live:
        raise RuntimeError("no data parallel replica is alive")
    least = min(live, key=lambda r: (loads[r], r))
    if affinity is not None and matched_blocks > 0 and 0 <= affinity < len(loads) and alive[affinity] \
            and loads[affinity] - loads[least] <= imbalance:
        return RouteDecision(affinity, matched_blocks, "prefix")
    return RouteDecision(least, 0, "load")


class DPRouter:
    """Routes requests over `num_replicas` replicas and tracks their in-flight counts.

    block_size: the engines' KV block size (prefix hashes are per full block). max_blocks bounds the
    block -> replica table (least recently routed entries are forgotten first, as the replicas'
    caches evict theirs)."""

    def __init__(self, num_replicas: int, block_size: int, imbalance: int, max_blocks: int = 65536) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.block_size = block_size
        self.imbalance = imbalance
        self.max_blocks = max_blocks
        self.loads = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.routed = [0] * num_replicas  # requests ever routed to each replica (for logs and tests)
        self._owner: OrderedDict[bytes, int] = OrderedDict()

    def route(self, prompt_token_ids: Sequence[int], weight: int = 1) -> RouteDecision:
        """Picks the replica for a prompt, counts `weight` requests in flight on it, and records the
        prompt's blocks as cached there."""
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size)
        affinity, matched = None, 0
        for i in range(len(hashes) - 1, -1, -1):  # the longest known prefix wins
            owner = self._owner.get(hashes[i])
            if owner is not None:
                affinity, matched = owner, i + 1
                break
        decision = choose_replica(self.loads, self.alive, affinity, matched, self.imbalance)
        for h in hashes:
            self._owner[h] = decision.replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)
        self.loads[decision.replica] += weight
        self.routed[decision.replica] += weight
        return decision

    def finished(self, replica: int, weight: int = 1) -> None:
        self.loads[replica] = max(self.loads[replica] - weight, 0)

    def mark_dead(self, replica: int) -> None:
        """A dead replica takes no more requests and its cached prefixes are forgotten."""
        self.alive[replica] = False
        self.loads[replica] = 0
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]
