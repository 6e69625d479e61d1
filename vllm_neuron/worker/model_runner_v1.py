"""Model Runner V1: per-request state on the host; every step's inputs are built on the host.

Every step pads the host-built inputs (token ids, positions, slots, block tables, per-row sampling
parameters and uniforms) to its bucket and runs that bucket's graph: model forward, logits of the
sampled rows and in-graph sampling, all inside one compiled function per bucket. Under async
scheduling the previous step's device tokens feed the next decode step (worker/token_passing.py).
"""
from __future__ import annotations

import torch

from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.model.loader import Checkpoint
from vllm_neuron.step import ModelRunnerOutput, SchedulerOutput
from vllm_neuron.worker.graphs import StepGraphs
from vllm_neuron.worker.input_builder import build_decode_inputs
from vllm_neuron.worker.runner_base import ModelRunnerBase
from vllm_neuron.worker.token_passing import TokenPassing


class ModelRunnerV1(ModelRunnerBase):
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                 backend: str) -> None:
        super().__init__(config, checkpoint, device, dtype, backend)
        self.token_passing = TokenPassing()

    def _make_graphs(self) -> StepGraphs:
        return StepGraphs(self.model, self.odsc, self.block_size, self.use_kernels)

    def _run_prefill(self, chunks, num_tokens: int, num_context: int, masks: dict | None = None):
        def row_inputs(rows: int) -> tuple:
            s = self.sampling.graph_tensors([c.req_id for c in chunks], rows)
            return tuple(self._t(s[k]) for k in ("temperature", "top_k", "top_p", "uniform"))
        return self._prefill_graph(chunks, num_tokens, num_context, masks, row_inputs)

    def _run_decode(self, chunks, batch: int, context: int, masks: dict | None = None,
                    input_ids: torch.Tensor | None = None):
        x = build_decode_inputs(chunks, batch, context, self.block_size)
        s = self.sampling.graph_tensors([c.req_id for c in chunks], batch)
        with torch.inference_mode():
            ids = input_ids if input_ids is not None else self._t(x.input_ids)
            graph = self._graph("decode", batch, context)
            return graph(ids, self._t(x.positions), self._t(x.slot_mapping), self._t(x.block_tables),
                         self._t(self._bitmask(chunks, batch, masks or {})), self._t(s["temperature"]),
                         self._t(s["top_k"]), self._t(s["top_p"]), self._t(s["uniform"]), self.kv_caches)

    # -- one step --------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids:
            self.sampling.remove(rid)
        for rid, n in sched.preempted_req_ids.items():
            self.sampling.truncate(rid, n)
        for data in sched.new_requests:
            self.sampling.add(data)
        chunks = sched.chunks
        size, context, name, padding = self._step_bucket(sched)
        fallback = passed = False
        if sched.kind == "prefill":
            tokens, logits = self._run_prefill(chunks, size, context, sched.grammar_bitmask)
        else:
            chunks, passed_ids, fallback = self.token_passing.resolve(chunks, size)
            passed = passed_ids is not None
            tokens, logits = self._run_decode(chunks, size, context, sched.grammar_bitmask, passed_ids)
        req_ids, sampled, logprobs = self._finalize_rows(chunks, tokens, logits)
        host_rows = any(self.sampling.states[r].on_host for r in req_ids)
        self.token_passing.record(sched.kind, [c.req_id for c in chunks], tokens,
                                  {r: t[0] for r, t in sampled.items()}, host_rows)
        return ModelRunnerOutput(sampled, logprobs, bucket_name=name, num_padding=padding,
                                 async_fallback=fallback, tokens_passed_on_device=passed)
