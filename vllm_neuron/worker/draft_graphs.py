"""What MRv1's graphs with a draft model inside them (EAGLE3, DFlash) share: the draft, its taps, K, and
the target forward that also returns the tapped hidden states. kv_caches holds the target's K/V pairs,
then the draft's `num_draft_kv` (one per draft layer)."""
from __future__ import annotations

from vllm_neuron.worker.spec_decode import VerifyGraphs


class DraftModelGraphs(VerifyGraphs):
    def __init__(self, model, odsc, block_size: int, use_kernels: bool, paged_decode: bool, kv_layout, draft,
                 aux_layers: tuple[int, ...], k: int, num_draft_kv: int) -> None:
        super().__init__(model, odsc, block_size, use_kernels, paged_decode, kv_layout)
        self.draft = draft
        self.aux_layers = aux_layers
        self.k = k
        self.num_draft_kv = num_draft_kv

    def _target_forward(self, input_ids, positions, kv_caches, meta, group_metas=()):
        # A draft model keeps one KV cache group (ModelRunnerV1.kv_groups_unsupported): one pair per layer.
        return self.model(input_ids, positions, kv_caches[:-self.num_draft_kv], meta, aux_layers=self.aux_layers)

    def _tapped_prefill(self, input_ids, positions, slot_mapping, query_seq, attn_a, attn_b, logits_indices,
                        bitmask, temperature, top_k, top_p, uniform, kv_caches):
        """The target's prefill: (tokens, logits, tapped hidden states, metadata)."""
        meta = self.prefill_meta(slot_mapping, positions, query_seq, attn_a, attn_b)
        hidden, aux = self._target_forward(input_ids, positions, kv_caches, meta)
        logits = self.model.compute_logits(hidden[logits_indices]).float()
        return (*self._sample(logits, bitmask, temperature, top_k, top_p, uniform), aux, meta)

    def _tapped_decode(self, input_ids, positions, slot_mapping, block_tables, bitmask, temperature, top_k, top_p,
                       uniform, kv_caches):
        """The target's decode step: (tokens, logits, tapped hidden states, metadata)."""
        meta = self.decode_meta(slot_mapping, block_tables, positions)
        hidden, aux = self._target_forward(input_ids, positions, kv_caches, meta)
        logits = self.model.compute_logits(hidden).float()
        return (*self._sample(logits, bitmask, temperature, top_k, top_p, uniform), aux, meta)
