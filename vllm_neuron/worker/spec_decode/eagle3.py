"""EAGLE3 speculation: the draft head runs inside every bucket graph.

Every graph of the step (prefill, decode, verify) also taps the target's three hidden states, runs the
draft over the step's rows (writing the draft's K/V at the same slots as the target's, in its own cache:
`draft_kv`) and returns the next drafts, so proposing costs no extra launch and no host round trip:

* prefill: row t's draft input is the token after it (the sampled one for a chunk's last row); the
  draft at each sequence's last row gives 1 draft for the first decode step;
* decode: the draft reads (sampled token, tapped features) at the row's position, then K - 1 more
  autoregressive steps (its own pre-norm output fed back) give K drafts;
* verify: the draft catches up over the 1 + K rows (the emitted tokens as inputs; rows past the
  rejection write K/V that the next round overwrites), then continues from the last emitted row.

Speculative draft steps write K/V at positions past the verified ones: inside allocated blocks they are
overwritten before anything reads them; past the table they land in the null block. Either way they
only change which drafts come out, never the verified output. Drafts are the draft's argmax (a one-hot
draft distribution), which the rejection sampler verifies exactly for greedy and random sampling.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_neuron.model.eagle3 import load_eagle3_draft
from vllm_neuron.worker.graphs import GraphBase
from vllm_neuron.worker.spec_decode.base import Target
from vllm_neuron.worker.spec_decode.draft_model import DraftModelSpeculator
from vllm_neuron.worker.step_inputs import DecodeInputs, PrefillInputs, VerifyInputs


class Eagle3Speculator(DraftModelSpeculator):
    method = "eagle3"

    def _load_draft(self, target: Target):
        draft, nbytes = load_eagle3_draft(self.spec.model, max_positions=target.max_model_len, dtype=target.dtype,
                                          device=target.device, target_vocab=target.vocab_size,
                                          target_hidden=target.hidden_size)
        return draft, nbytes, f"draft vocabulary {draft.cfg.draft_vocab_size}"

    def kv_layers(self) -> list[tuple[int, int]]:
        return [self.draft.kv_cache_spec()]

    def draft_graphs(self) -> "Eagle3Graphs":
        return Eagle3Graphs(self.draft, self.aux_layers, self.k)

    def step_context(self, max_seq_len: int) -> int:
        # The draft's K - 1 steps past the step's last row read and write K/V there: room in the table.
        return max_seq_len + self.k

    def prefill_inputs(self, chunks, num_tokens: int, rows: int, all_tokens) -> tuple[np.ndarray, np.ndarray]:
        return prefill_draft_inputs(chunks, num_tokens, all_tokens)


class Eagle3Graphs:
    """EAGLE3's part of the bucket graphs (worker/graphs.py's DraftGraphs)."""

    def __init__(self, draft, aux_layers: tuple[int, ...], k: int) -> None:
        self.draft = draft
        self.aux_layers = aux_layers
        self.k = k

    def _pass(self, g: GraphBase, ids, positions, taps, kv_cache, meta):
        return self.draft(ids, positions, self.draft.fc(taps), kv_cache, meta, g.model.model.embed_tokens)

    def _continue(self, g: GraphBase, first, prenorm, last_pos, block_tables, kv_cache) -> torch.Tensor:
        """[B, K] drafts: `first` then K - 1 autoregressive steps, one row per sequence."""
        drafts = [first]
        bs = g.options.block_size
        rows = torch.arange(block_tables.shape[0], device=block_tables.device)
        limit = block_tables.shape[1] * bs - 1  # stay inside the context bucket's table
        for j in range(1, self.k):
            pos = (last_pos + j).clamp(max=limit)
            slots = block_tables[rows, pos // bs] * bs + pos % bs
            prenorm = self.draft(drafts[-1], pos, prenorm, kv_cache, g.decode_meta(slots, block_tables, pos),
                                 g.model.model.embed_tokens)
            drafts.append(self.draft.draft_tokens(prenorm))
        return torch.stack(drafts, dim=1)

    def after_prefill(self, g: GraphBase, x: PrefillInputs, tokens, taps, meta) -> torch.Tensor:
        draft_next, draft_src = x.draft
        ids = torch.where(draft_next >= 0, draft_next, tokens[draft_src])
        prenorm = self._pass(g, ids, x.positions, taps, x.draft_kv[0], meta)
        return self.draft.draft_tokens(prenorm[x.logits_indices])[:, None]

    def after_decode(self, g: GraphBase, x: DecodeInputs, tokens, taps, meta) -> torch.Tensor:
        prenorm = self._pass(g, tokens, x.positions, taps, x.draft_kv[0], meta)
        return self._continue(g, self.draft.draft_tokens(prenorm), prenorm, x.positions, x.block_tables,
                              x.draft_kv[0])

    def after_verify(self, g: GraphBase, x: VerifyInputs, tokens, num_emitted, taps, meta) -> torch.Tensor:
        b, k1 = tokens.shape
        prenorm = self._pass(g, tokens.clamp(min=0).reshape(-1), x.positions, taps, x.draft_kv[0], meta)
        last = torch.arange(b, device=tokens.device) * k1 + num_emitted - 1  # each sequence's last emitted row
        h = prenorm[last]
        return self._continue(g, self.draft.draft_tokens(h), h, x.positions[last], x.block_tables, x.draft_kv[0])


def prefill_draft_inputs(chunks, num_tokens: int, all_tokens) -> tuple[np.ndarray, np.ndarray]:
    """(draft_next [T], draft_src [T]): each prefill row's next token for the draft, or -1 where it is the
    token sampled at chunk `draft_src[t]`'s row (a chunk that ends its request's known tokens).
    all_tokens(req_id): the request's prompt and output tokens so far."""
    nxt = np.zeros(num_tokens, np.int64)
    src = np.zeros(num_tokens, np.int64)
    t = 0
    for i, ch in enumerate(chunks):
        n = len(ch.token_ids)
        nxt[t:t + n - 1] = ch.token_ids[1:]
        known = all_tokens(ch.req_id)
        end = ch.start_pos + n
        if end < len(known):
            nxt[t + n - 1] = known[end]
        else:
            nxt[t + n - 1], src[t + n - 1] = -1, i
        t += n
    return nxt, src
