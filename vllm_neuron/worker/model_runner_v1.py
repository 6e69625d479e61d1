"""Model Runner V1: per-request state on the host; every step's inputs are built on the host.

Every step pads the host-built inputs (token ids, positions, slots, block tables, per-row sampling
parameters and uniforms) to its bucket and runs that bucket's graph: model forward, logits of the
sampled rows and in-graph sampling, all inside one compiled function per bucket. Under async
scheduling the previous step's device tokens feed the next decode step (worker/token_passing.py).
With a speculator (worker/spec_decode/), a decode step whose chunks carry drafts runs the
`verify_b{B}_k{K}` graph instead, and every step ends by asking it for the next drafts.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.utils._pytree as pytree

from vllm_neuron.config import buckets as B
from vllm_neuron.logger import init_logger
from vllm_neuron.step import ModelRunnerOutput, SchedulerOutput
from vllm_neuron.worker.graphs import GraphOptions, StepGraphs
from vllm_neuron.worker.input_builder import build_decode_inputs
from vllm_neuron.worker.model_kinds.base import GraphSpec
from vllm_neuron.worker.runner_base import ModelRunnerBase
from vllm_neuron.worker.spec_decode import Speculator, Target, make_speculator
from vllm_neuron.worker.spec_decode.verify_inputs import build_verify_inputs, verify_bucket_name
from vllm_neuron.worker.step_inputs import DecodeInputs, RowSampling, StepOutput, VerifyInputs
from vllm_neuron.worker.step_timing import timed_step
from vllm_neuron.worker.token_passing import TokenPassing

logger = init_logger(__name__)


class ModelRunnerV1(ModelRunnerBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token_passing = TokenPassing()

    def _make_speculator(self) -> Speculator | None:
        spec = make_speculator(self.config.speculative, self.config.max_model_len)
        if spec is not None:
            logger.info("Speculative decoding: %s; verification graphs verify_b{B}_k%d", spec.describe(), spec.k)
        return spec

    def _load_speculator(self) -> int:
        if self.speculator is None:
            return 0
        hf = self.ckpt.hf_config.get_text_config()
        return self.speculator.load(Target(
            self.model, self.model_spec.num_layers, hf.vocab_size, hf.hidden_size, self.dtype, self.device,
            self.kernels, self.config.max_model_len, self.block_size,
            max(self.config.max_num_seqs, *self.decode_buckets)))

    def kv_groups_unsupported(self) -> str | None:
        return self.speculator.kv_groups_unsupported() if self.speculator is not None else None

    def _make_graphs(self, options: GraphOptions) -> StepGraphs:
        return StepGraphs(self.model, options, self.speculator.draft_graphs() if self.speculator else None)

    def graph_names(self) -> list[GraphSpec]:
        out = super().graph_names()
        if self.speculator is not None:  # one verification graph beside each decode graph
            out += [GraphSpec(self._graph_name("verify", s.size, s.context), "verify", s.size, s.context)
                    for s in out if s.kind == "decode"]
        return out

    def _graph_name(self, kind: str, size: int, context: int) -> str:
        if kind == "verify":
            return verify_bucket_name(size, self.speculator.k, context if len(self.context_buckets) > 1 else None)
        return super()._graph_name(kind, size, context)

    def _step_bucket(self, sched: SchedulerOutput) -> tuple[int, int, str, int]:
        size, context, name, padding = super()._step_bucket(sched)
        if sched.kind == "decode" and self.speculator is not None:
            reach = self.speculator.step_context(sched.max_seq_len)
            context = B.select_bucket(self.context_buckets, min(reach, self.context_buckets[-1]))
            name = self._graph_name("decode", size, context)
            if any(c.num_draft_tokens for c in sched.chunks):
                name = self._graph_name("verify", size, context)
        return size, context, name, padding

    # -- step inputs -----------------------------------------------------------------------------
    def _row_sampling(self, req_ids: list[str], rows: int) -> RowSampling:
        s = self.sampling.graph_tensors(req_ids, rows)
        return RowSampling(*(self._t(s[k]) for k in ("temperature", "top_k", "top_p", "uniform")))

    def _row_extras(self, req_ids: list[str], rows: int, repeat: int = 1) -> dict[str, torch.Tensor]:
        """The model kinds' per-row inputs, each sequence's value repeated over its `repeat` rows."""
        return {name: self._t(np.repeat(v, repeat)) for k in self.kinds
                for name, v in k.row_extras(req_ids, rows).items()}

    def _run_prefill(self, chunks, num_tokens: int, num_context: int, masks: dict | None = None) -> StepOutput:
        req_ids = [c.req_id for c in chunks]
        x, _ = self._prefill_inputs(chunks, num_tokens, num_context, masks,
                                    lambda rows: self._row_sampling(req_ids, rows))
        if self.speculator is not None:
            draft = self.speculator.prefill_inputs(chunks, num_tokens, x.logits_indices.shape[0],
                                                   self.sampling.all_tokens)
            x.draft = pytree.tree_map(lambda a: self._t(a) if isinstance(a, np.ndarray) else a, draft)
        with torch.inference_mode():
            return self._call_prefill(x, chunks, num_tokens, num_context)

    def _run_decode(self, chunks, batch: int, context: int, masks: dict | None = None,
                    input_ids: torch.Tensor | None = None) -> StepOutput:
        a = build_decode_inputs(chunks, batch, context, self.block_size)
        req_ids = [c.req_id for c in chunks]
        x = DecodeInputs(input_ids if input_ids is not None else self._t(a.input_ids), self._t(a.positions),
                         self._t(a.slot_mapping), self._t(a.block_tables), self.kv_caches,
                         self._row_sampling(req_ids, batch), self._t(self._bitmask(chunks, batch, masks or {})),
                         self._group_tables(chunks, lambda c: build_decode_inputs(c, batch, context, self.block_size),
                                            "block_tables"),
                         self._row_extras(req_ids, batch), self.draft_kv)
        with torch.inference_mode():
            return self._run_graph("decode", batch, context, x, chunks)

    def _run_verify(self, chunks, batch: int, context: int, masks: dict | None = None) -> StepOutput:
        k = self.speculator.k
        a = build_verify_inputs(chunks, batch, k, context // self.block_size, self.block_size)
        req_ids = [c.req_id for c in chunks]
        acc, smp = self.speculator.uniforms(self.sampling.states, req_ids, batch)
        x = VerifyInputs(self._t(a.input_ids), self._t(a.positions), self._t(a.slot_mapping), self._t(a.block_tables),
                         self._t(a.draft_ids), self._t(a.num_drafts), self.kv_caches,
                         self._row_sampling(req_ids, batch), self._t(acc), self._t(smp),
                         self._t(self._verify_bitmask(chunks, batch, masks)),
                         self._group_tables(chunks, lambda c: build_verify_inputs(
                             c, batch, k, context // self.block_size, self.block_size), "block_tables"),
                         self._row_extras(req_ids, batch, k + 1), self.draft_kv)
        with torch.inference_mode():
            return self._run_graph("verify", batch, context, x, chunks, k + 1)

    def _verify_bitmask(self, chunks, batch: int, masks: dict | None) -> np.ndarray | None:
        """[B * (1 + K), words]: a grammar request's masks at its verified positions, all-allowed elsewhere."""
        k1 = self.speculator.k + 1
        rows = self._bitmask(chunks, batch * k1, {})
        if rows is None and not masks:
            return None
        rows = rows if rows is not None else np.full((batch * k1, self._bitmask_words), -1, np.int32)
        for i, c in enumerate(chunks):
            m = (masks or {}).get(c.req_id)
            if m is not None:
                m = np.atleast_2d(m)
                rows[i * k1:i * k1 + m.shape[0]] = m
        return rows

    # -- one step --------------------------------------------------------------------------------
    def _execute_verify(self, sched: SchedulerOutput, size: int, context: int) -> tuple[dict, dict, StepOutput]:
        """A decode step with drafts: (sampled, logprobs, graph output); row i emits its accepted drafts and one
        more."""
        out = self._run_verify(sched.chunks, size, context, sched.grammar_bitmask)
        req_ids, sampled, logprobs = self._finalize_rows(sched.chunks, out.tokens[:, 0], out.logits)
        emitted = out.num_emitted.tolist()
        rows = out.tokens.tolist()
        for i, rid in enumerate(req_ids):
            extra = rows[i][1:emitted[i]]  # rows without drafts (host-sampled ones included) emit one
            if extra:
                sampled[rid] = sampled[rid] + extra
                self.sampling.states[rid].output_token_ids.extend(extra)
        return sampled, logprobs, out

    def _drafts(self, sched: SchedulerOutput, chunks, sampled: dict, graph_drafts) -> dict[str, list[int]]:
        """Next step's drafts, for the requests whose next step may use them (the scheduler leaves paused
        requests out)."""
        if self.speculator is None:
            return {}
        wanted = [r for r in sampled if sched.spec_req_ids is None or r in sched.spec_req_ids]
        rows = {c.req_id: i for i, c in enumerate(chunks) if c.sample}
        return self.speculator.propose(self.sampling.states, wanted, rows, graph_drafts)

    @timed_step
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.pooler is not None:
            return self._execute_pooling(sched)
        self._back_kv_pages(sched)
        self._joins_and_leaves(sched)
        chunks = sched.chunks
        size, context, name, padding = self._step_bucket(sched)
        if name.startswith("verify"):
            sampled, logprobs, out = self._execute_verify(sched, size, context)
            return ModelRunnerOutput(sampled, logprobs, bucket_name=name, num_padding=padding,
                                     spec_token_ids=self._drafts(sched, chunks, sampled, out.drafts))
        fallback = passed = False
        if sched.kind == "prefill":
            out = self._run_prefill(chunks, size, context, sched.grammar_bitmask)
        else:
            chunks, passed_ids, fallback = self.token_passing.resolve(chunks, size)
            passed = passed_ids is not None
            out = self._run_decode(chunks, size, context, sched.grammar_bitmask, passed_ids)
        req_ids, sampled, logprobs = self._finalize_rows(chunks, out.tokens, out.logits)
        host_rows = any(self.sampling.states[r].on_host for r in req_ids)
        self.token_passing.record(sched.kind, [c.req_id for c in chunks], out.tokens,
                                  {r: t[0] for r, t in sampled.items()}, host_rows)
        return ModelRunnerOutput(sampled, logprobs, bucket_name=name, num_padding=padding,
                                 async_fallback=fallback, tokens_passed_on_device=passed,
                                 prompt_logprobs=self._take_prompt_logprobs(),
                                 spec_token_ids=self._drafts(sched, chunks, sampled, out.drafts))
