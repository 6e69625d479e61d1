"""MRv1's EAGLE3 speculative decoding: the bucket graphs with the draft head inside them.

Every graph of the step (prefill, decode, verify) also taps the target's three hidden states, runs the
draft over the step's rows (writing the draft's K/V at the same slots as the target's, in its own cache:
the last entry of `kv_caches`) and returns the next drafts, so proposing costs no extra launch and no
host round trip:

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

from vllm_neuron.worker.draft_graphs import DraftModelGraphs


class Eagle3Graphs(DraftModelGraphs):
    def __init__(self, model, odsc, block_size: int, use_kernels: bool, paged_decode: bool, kv_layout, draft,
                 aux_layers: tuple[int, ...], k: int) -> None:
        super().__init__(model, odsc, block_size, use_kernels, paged_decode, kv_layout, draft, aux_layers, k, 1)

    def _draft_pass(self, ids, positions, aux, kv_cache, meta):
        return self.draft(ids, positions, self.draft.fc(aux), kv_cache, meta, self.model.model.embed_tokens)

    def _continue(self, first, prenorm, last_pos, block_tables, kv_cache) -> torch.Tensor:
        """[B, K] drafts: `first` then K - 1 autoregressive steps, one row per sequence."""
        drafts = [first]
        rows = torch.arange(block_tables.shape[0], device=block_tables.device)
        limit = block_tables.shape[1] * self.block_size - 1  # stay inside the context bucket's table
        for j in range(1, self.k):
            pos = (last_pos + j).clamp(max=limit)
            slots = block_tables[rows, pos // self.block_size] * self.block_size + pos % self.block_size
            prenorm = self.draft(drafts[-1], pos, prenorm, kv_cache, self.decode_meta(slots, block_tables, pos),
                                 self.model.model.embed_tokens)
            drafts.append(self.draft.draft_tokens(prenorm))
        return torch.stack(drafts, dim=1)

    def prefill(self, input_ids, positions, slot_mapping, query_seq, attn_a, attn_b, logits_indices, bitmask,
                temperature, top_k, top_p, uniform, draft_next, draft_src, kv_caches):
        tokens, logits, aux, meta = self._tapped_prefill(input_ids, positions, slot_mapping, query_seq, attn_a, attn_b,
                                                         logits_indices, bitmask, temperature, top_k, top_p, uniform,
                                                         kv_caches)
        ids = torch.where(draft_next >= 0, draft_next, tokens[draft_src])
        prenorm = self._draft_pass(ids, positions, aux, kv_caches[-1], meta)
        return tokens, logits, self.draft.draft_tokens(prenorm[logits_indices])[:, None]

    def decode(self, input_ids, positions, slot_mapping, block_tables, bitmask, temperature, top_k, top_p,
               uniform, kv_caches):
        tokens, logits, aux, meta = self._tapped_decode(input_ids, positions, slot_mapping, block_tables, bitmask,
                                                        temperature, top_k, top_p, uniform, kv_caches)
        prenorm = self._draft_pass(tokens, positions, aux, kv_caches[-1], meta)
        drafts = self._continue(self.draft.draft_tokens(prenorm), prenorm, positions, block_tables, kv_caches[-1])
        return tokens, logits, drafts

    def verify(self, input_ids, positions, slot_mapping, block_tables, draft_ids, num_drafts, bitmask,
               temperature, top_k, top_p, uniform_accept, uniform_sample, kv_caches):
        tokens, num_emitted, logits0, meta, aux = self._verify(
            input_ids, positions, slot_mapping, block_tables, draft_ids, num_drafts, bitmask, temperature, top_k,
            top_p, uniform_accept, uniform_sample, kv_caches)
        b, k1 = tokens.shape
        prenorm = self._draft_pass(tokens.clamp(min=0).reshape(-1), positions, aux, kv_caches[-1], meta)
        last = torch.arange(b, device=tokens.device) * k1 + num_emitted - 1  # each sequence's last emitted row
        h = prenorm[last]
        drafts = self._continue(self.draft.draft_tokens(h), h, positions[last], block_tables, kv_caches[-1])
        return tokens, num_emitted, logits0, drafts


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
