"""The bucket graphs of a multimodal model (MRv1): the text graphs take the vision embeddings, their
placement mask, the deepstack features and M-RoPE positions as inputs; decode adds each row's rotary
delta. The vision tower runs in its own function (`encode`), outside the text graphs."""
from __future__ import annotations

from vllm_neuron.worker.graphs import StepGraphs


class MultimodalStepGraphs(StepGraphs):
    def prefill(self, input_ids, positions, slot_mapping, query_seq, attn_a, attn_b, logits_indices, bitmask,
                temperature, top_k, top_p, uniform, rope_positions, mm_embeds, mm_mask, deepstack, kv_caches):
        meta = self.prefill_meta(slot_mapping, positions, query_seq, attn_a, attn_b)
        x = self.model.embed(input_ids, mm_embeds, mm_mask)
        hidden = self.model(input_ids, rope_positions, kv_caches, meta, inputs_embeds=x, deepstack=deepstack)
        logits = self.model.compute_logits(hidden[logits_indices])
        return self._sample(logits, bitmask, temperature, top_k, top_p, uniform)

    def decode(self, input_ids, positions, slot_mapping, block_tables, bitmask, temperature, top_k, top_p,
               uniform, rope_delta, kv_caches):
        meta = self.decode_meta(slot_mapping, block_tables, positions)
        rope = (positions + rope_delta)[None].expand(3, -1)
        hidden = self.model(input_ids, rope, kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        return self._sample(logits, bitmask, temperature, top_k, top_p, uniform)

    def encode(self, pixels, interp_idx, interp_w, rot_pos, segment):
        return self.model.encode(pixels, interp_idx, interp_w, rot_pos, segment)
