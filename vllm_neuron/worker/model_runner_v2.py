"""Model Runner V2: per-request state on the device; input preparation, forward, sampling and the
state update in one compiled graph per bucket.

What differs from MRv1 (its sibling over runner_base.py, which holds loading, KV allocation, the compiler,
bucket names, warm-up and the model kinds' hooks):
* Decode: the host sends only the row -> slot map (rebuilt when the batch's request list changes),
  new block-table entries and the grammar bitmask. The graph gathers each row's last token, position,
  block table and model-kind inputs (e.g. a multimodal request's M-RoPE delta) from the slot state, runs the
  model, samples, and writes the sampled token and the next position back into the state. Decode chunks'
  token ids are never read: under async scheduling they may be `step.PLACEHOLDER_TOKEN_ID`; the device state
  holds the real token.
* Prefill: prompt tokens are new data, so inputs are host-built as in MRv1, plus each sampled row's
  slot; the graph writes those rows' token state as well as the KV cache.
* Random sampling draws a uniform per row inside the graph from (slot seed, position), so a seeded
  request samples the same text whatever its neighbours, with no host RNG per step; MRv1 and the host
  sampler draw the same number for the same token (model/layers/in_graph_sampler.py).
Rows that need host sampling (penalties, logprobs, ...) are sampled from the returned logits as in
MRv1, and their token is written into the slot before execute returns.
"""
from __future__ import annotations

import torch

from vllm_neuron.sampling_params import SAMPLING_EPS
from vllm_neuron.step import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from vllm_neuron.worker.batch_state import BatchState, SlotParams
from vllm_neuron.worker.graphs import GraphOptions, SlotStepGraphs
from vllm_neuron.worker.model_setup import LoadStats
from vllm_neuron.worker.runner_base import ModelRunnerBase
from vllm_neuron.worker.step_inputs import SlotDecodeInputs, SlotRows, StepOutput
from vllm_neuron.worker.step_timing import timed_step


class ModelRunnerV2(ModelRunnerBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state: BatchState | None = None  # made with the model (its kinds name per-slot inputs)
        self._context_cols: dict[int, torch.Tensor] = {}

    def load_model(self) -> LoadStats:
        stats = super().load_model()
        extras = {name: dt for k in self.kinds for name, dt in k.slot_extras().items()}
        self.state = BatchState(self.config.max_num_seqs, self.config.max_model_len // self.block_size, self.device,
                                self.kv_layout.num_groups, extras)
        return stats

    def _graph_options(self) -> dict:
        # Same bucket names as MRv1 but different graphs: keep their compile-cache manifests apart.
        return {**super()._graph_options(), "model_runner": "v2"}

    def kv_groups_unsupported(self) -> str | None:
        return None

    def _make_graphs(self, options: GraphOptions) -> SlotStepGraphs:
        return SlotStepGraphs(self.model, options)

    def _run_prefill(self, chunks: list[ScheduledChunk], num_tokens: int, num_context: int,
                     masks: dict | None = None) -> StepOutput:
        def sampling(rows: int) -> SlotRows:
            return SlotRows(self.state.row_slots([c.req_id if c.sample else None for c in chunks], rows),
                            self.state.state)
        x, _ = self._prefill_inputs(chunks, num_tokens, num_context, masks, sampling)
        with torch.inference_mode():
            return self._call_prefill(x, chunks, num_tokens, num_context)

    def _run_decode(self, chunks: list[ScheduledChunk], batch: int, context: int,
                    masks: dict | None = None) -> StepOutput:
        cols = self._context_cols.get(context)
        if cols is None:
            cols = self._context_cols[context] = torch.arange(context // self.block_size, device=self.device)
        x = SlotDecodeInputs(self.state.row_slots([c.req_id for c in chunks], batch), cols, self.state.state,
                             self.kv_caches, self._t(self._bitmask(chunks, batch, masks or {})))
        with torch.inference_mode():
            return self._run_graph("decode", batch, context, x, chunks)

    # -- one step --------------------------------------------------------------------------------
    def _slot_params(self, req_id: str) -> SlotParams:
        st = self.sampling.states[req_id]
        p = st.params
        seed = st.seed  # kept across preemption: the rejoined slot draws the same numbers
        if self.odsc is None or self.odsc.all_greedy or st.on_host or p.temperature < SAMPLING_EPS:
            return SlotParams(seed=seed)  # greedy in the graph; host rows are resampled on the host
        return SlotParams(p.temperature, self.odsc.effective_top_k(p.top_k), p.top_p, seed)

    def _apply_joins_and_leaves(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.state.leave(rid)
        for rid in sched.preempted_req_ids:
            self.state.leave(rid)  # its KV is gone; it rejoins when prefilled again
        self._joins_and_leaves(sched)
        for c in sched.chunks:
            if not self.state.has(c.req_id):
                extras = {name: v for k in self.kinds for name, v in k.slot_values(c.req_id).items()}
                self.state.join(c.req_id, self._slot_params(c.req_id), extras)
        self.state.sync_block_tables([(c.req_id, c.block_ids) for c in sched.chunks])
        for g in range(1, self.kv_layout.num_groups):
            self.state.sync_block_tables([(c.req_id, c.group_block_ids[g - 1]) for c in sched.chunks], g)

    @timed_step
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.pooler is not None:
            return self._execute_pooling(sched)
        self._back_kv_pages(sched)
        self._apply_joins_and_leaves(sched)
        chunks = sched.chunks
        size, context, name, padding = self._step_bucket(sched)
        run = self._run_prefill if sched.kind == "prefill" else self._run_decode
        out = run(chunks, size, context, sched.grammar_bitmask)
        req_ids, sampled, logprobs = self._finalize_rows(chunks, out.tokens, out.logits)
        host = [r for r in req_ids if self.sampling.states[r].on_host]
        self.state.set_last_tokens(host, [sampled[r][0] for r in host])
        return ModelRunnerOutput(sampled, logprobs, bucket_name=name, num_padding=padding,
                                 prompt_logprobs=self._take_prompt_logprobs())
