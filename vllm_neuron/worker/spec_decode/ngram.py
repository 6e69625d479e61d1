"""N-gram (prompt lookup) speculation: drafts proposed on the host after every step from each request's own
tokens (ngram_proposer.py); no draft model, nothing inside the graphs but the verification."""
from __future__ import annotations

import torch

from vllm_neuron.worker.sampling_state import RequestState
from vllm_neuron.worker.spec_decode.base import Speculator
from vllm_neuron.worker.spec_decode.ngram_proposer import propose_ngram


class NgramSpeculator(Speculator):
    method = "ngram"

    def propose(self, states: dict[str, RequestState], wanted: list[str], rows: dict[str, int],
                graph_drafts: torch.Tensor | None) -> dict[str, list[int]]:
        out = {}
        for rid in wanted:
            st = states.get(rid)
            if not self.eligible(st):
                continue
            drafts = propose_ngram(st.data.prompt_token_ids + st.output_token_ids, self.spec.prompt_lookup_min,
                                   self.spec.prompt_lookup_max, self.k)
            if drafts:
                out[rid] = drafts
        return out
