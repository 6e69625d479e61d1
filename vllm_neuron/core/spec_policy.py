"""When speculation pays: per-request acceptance back-off and vLLM's `disable_by_batch_size` (pure).

A verification step costs more than a decode step (1 + K rows per sequence; an EAGLE3 draft also runs its
K steps), so drafts that are mostly rejected make decoding slower than no speculation at all. Two rules:

* Per request: its last `window` verification rounds are kept; once it has `window` of them and they
  accepted less than `min_acceptance` of their draft tokens, the request is paused: its next `backoff`
  decode steps carry no drafts, then one probe round does. A probe at or above the bar resumes
  speculation (history cleared, back-off back to its initial length); below it, the pause doubles, up
  to `max_backoff` steps. A decode step in which no request carries drafts runs the plain decode graph,
  so a paused workload costs one probe verification every `max_backoff` steps at worst.
* Per step (vLLM's `disable_by_batch_size`, as its V0 worker applied it): a step with at least that many
  running requests carries no drafts - at large batches decode is compute-bound and verification
  rows are not free.

Drafts never change what is emitted (the rejection sampler keeps the target's output), so these rules
change speed only, never tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Defaults. The bar is where speculation stops paying: a verification costs 1.1-1.3x a decode step for
# n-gram and 1.4-1.75x with an EAGLE3 draft's K steps (0.57-0.72x decode speed at 0% acceptance, eager,
# CPU), so at K=4 it needs about 0.2-0.7 accepted tokens per round; 15% of K=4 is 0.6. Eight rounds keep
# a request whose drafts are often right (a 40% rate) from pausing on a few unlucky rounds.
MIN_ACCEPTANCE = 0.15
WINDOW = 8
INITIAL_BACKOFF = 8
MAX_BACKOFF = 128


@dataclass
class _RequestState:
    rounds: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (drafted, accepted)
    paused: int = 0  # decode steps left without drafts
    backoff: int = INITIAL_BACKOFF
    probing: bool = False  # the next round decides whether the request resumes


class SpecPolicy:
    def __init__(self, disable_by_batch_size: int | None = None, min_acceptance: float = MIN_ACCEPTANCE,
                 window: int = WINDOW, initial_backoff: int = INITIAL_BACKOFF, max_backoff: int = MAX_BACKOFF) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance = min_acceptance
        self.window = window
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self._req: dict[str, _RequestState] = {}
        self.num_pauses = 0  # requests paused (each pause and each failed probe counts)
        self.num_resumes = 0

    def batch_allows(self, num_running: int) -> bool:
        """Whether a step with this many running requests may carry drafts."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    def take_step(self, req_id: str) -> bool:
        """Whether the request may carry drafts in the decode step being scheduled; a paused request's
        pause counts this step down."""
        st = self._req.get(req_id)
        if st is None or st.paused == 0:
            return True
        st.paused -= 1
        return False

    def wants_drafts_next(self, req_id: str) -> bool:
        """Whether drafts proposed after the step being scheduled can be used by the request's next one."""
        st = self._req.get(req_id)
        return st is None or st.paused == 0

    def is_paused(self, req_id: str) -> bool:
        st = self._req.get(req_id)
        return st is not None and (st.paused > 0 or st.probing)

    def record(self, req_id: str, drafted: int, accepted: int) -> bool:
        """One verification round of the request; True when it pauses the request."""
        if drafted <= 0:
            return False
        st = self._req.setdefault(req_id, _RequestState(deque(maxlen=self.window), backoff=self.initial_backoff))
        if st.probing:
            st.probing = False
            if accepted >= self.min_acceptance * drafted:
                st.backoff = self.initial_backoff
                st.rounds.clear()
                st.rounds.append((drafted, accepted))
                self.num_resumes += 1
                return False
            st.backoff = min(2 * st.backoff, self.max_backoff)
            return self._pause(st)
        st.rounds.append((drafted, accepted))
        if len(st.rounds) < self.window:
            return False
        total = sum(d for d, _ in st.rounds)
        if sum(a for _, a in st.rounds) >= self.min_acceptance * total:
            return False
        return self._pause(st)

    def _pause(self, st: _RequestState) -> bool:
        st.paused, st.probing = st.backoff, True
        st.rounds.clear()
        self.num_pauses += 1
        return True

    def remove(self, req_id: str) -> None:
        self._req.pop(req_id, None)
