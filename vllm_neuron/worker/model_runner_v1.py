"""Model Runner V1: per-request state on the host; every step's inputs are built on the host.

Every step pads the host-built inputs (token ids, positions, slots, block tables, per-row sampling
parameters and uniforms) to its bucket and runs that bucket's graph: model forward, logits of the
sampled rows and in-graph sampling, all inside one compiled function per bucket. Under async
scheduling the previous step's device tokens feed the next decode step (worker/token_passing.py).
With speculative decoding, a decode step whose chunks carry drafts runs the `verify_b{B}_k{K}` graph
instead, and every step ends by proposing the next drafts (worker/spec_decode.py).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_neuron.config import buckets as B
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.logger import init_logger
from vllm_neuron.model.loader import Checkpoint
from vllm_neuron.spec_decode.verify_inputs import build_verify_inputs
from vllm_neuron.step import ModelRunnerOutput, SchedulerOutput
from vllm_neuron.worker.graphs import StepGraphs
from vllm_neuron.worker.input_builder import build_decode_inputs
from vllm_neuron.worker.runner_base import ModelRunnerBase
from vllm_neuron.worker.spec_decode import SpecDecoder, VerifyGraphs, verify_bucket_name
from vllm_neuron.worker.token_passing import TokenPassing

logger = init_logger(__name__)


class ModelRunnerV1(ModelRunnerBase):
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                 backend: str) -> None:
        super().__init__(config, checkpoint, device, dtype, backend)
        self.token_passing = TokenPassing()
        self.spec = SpecDecoder(config.speculative, config.max_model_len) if config.speculative else None
        self.draft = None  # the EAGLE3 / DFlash draft
        self.aux_layers: tuple[int, ...] = ()

    def _load_draft(self) -> int:
        if self.spec is None or not self.spec.spec.uses_draft_model:
            return 0
        from vllm_neuron.model.llama.model import LlamaModel

        method = self.spec.spec.method
        if type(getattr(self.model, "model", None)).forward is not LlamaModel.forward:
            raise ValueError(f"speculative_config.method={method!r} needs a target whose layers' hidden states can be "
                             f"tapped (Llama, Qwen3, Qwen3-MoE, gpt-oss); {type(self.model).__name__} is not one")
        hf = self.ckpt.hf_config.get_text_config()
        fit = dict(dtype=self.dtype, device=self.device, target_vocab=hf.vocab_size, target_hidden=hf.hidden_size)
        if method == "dflash":
            from vllm_neuron.model.dflash import load_dflash_draft

            # Block rows reach K + 1 positions past the last verified one.
            self.draft, nbytes = load_dflash_draft(self.spec.spec.model, target_layers=self.model_spec.num_layers,
                                                   k=self.spec.k, max_positions=self.config.max_model_len
                                                   + 2 * self.spec.k + 2, **fit)
            what = f"{self.draft.cfg.num_layers} non-causal layers over [bonus, {self.spec.k} x mask] blocks"
        else:
            from vllm_neuron.model.eagle3 import load_eagle3_draft

            self.draft, nbytes = load_eagle3_draft(self.spec.spec.model, max_positions=self.config.max_model_len,
                                                   **fit)
            what = f"draft vocabulary {self.draft.cfg.draft_vocab_size}"
        self.aux_layers = self.draft.cfg.aux_layers(self.model_spec.num_layers)
        logger.info("%s draft %s: target layers %s tapped, %s, %.1f MiB; drafts come out of every bucket graph",
                    method.upper(), self.spec.spec.model, list(self.aux_layers), what, nbytes / 2**20)
        return nbytes

    def _extra_kv_layers(self) -> list[tuple[int, int]]:
        if self.draft is None:
            return []
        return self.draft.kv_cache_specs() if self._dflash else [self.draft.kv_cache_spec()]

    @property
    def _dflash(self) -> bool:
        return self.spec is not None and self.spec.spec.method == "dflash"

    def _scratch_rows(self) -> int:
        return max(self.config.max_num_seqs, *self.decode_buckets)

    def _extra_kv_slots(self) -> int:
        if not self._dflash:
            return 0
        from vllm_neuron.worker.dflash import scratch_blocks

        return self._scratch_rows() * scratch_blocks(self.spec.k, self.block_size) * self.block_size

    def _graph_options(self) -> dict:
        opts = super()._graph_options()
        if self.draft is not None:  # the draft lives inside every graph
            opts[self.spec.spec.method] = {"config": self.draft.cfg.raw, "aux_layers": self.aux_layers,
                                           "k": self.spec.k}
        return opts

    def kv_groups_unsupported(self) -> str | None:
        # The draft models' graphs run the target with one metadata and one K/V pair per layer.
        spec = self.config.speculative
        return f"{spec.method.upper()} speculative decoding" if spec is not None and spec.uses_draft_model else None

    def _make_graphs(self) -> StepGraphs:
        args = (self.model, self.odsc, self.block_size, self.use_kernels, self.paged_decode, self.kv_layout)
        if self._dflash:
            from vllm_neuron.worker.dflash import DFlashGraphs

            return DFlashGraphs(*args, self.draft, self.aux_layers, self.spec.k, self._scratch_rows())
        if self.draft is not None:
            from vllm_neuron.worker.eagle3 import Eagle3Graphs

            return Eagle3Graphs(*args, self.draft, self.aux_layers, self.spec.k)
        return (VerifyGraphs if self.spec is not None else StepGraphs)(*args)

    def graph_names(self) -> list[tuple[str, str, int, int]]:
        out = super().graph_names()
        if self.spec is not None:  # one verification graph beside each decode graph
            out += [(self._graph_name("verify", size, ctx), "verify", size, ctx) for _, kind, size, ctx in out
                    if kind == "decode"]
        return out

    def _graph_name(self, kind: str, size: int, context: int) -> str:
        if kind == "verify":
            return verify_bucket_name(size, self.spec.k, context if len(self.context_buckets) > 1 else None)
        return super()._graph_name(kind, size, context)

    def _step_bucket(self, sched: SchedulerOutput) -> tuple[int, int, str, int]:
        size, context, name, padding = super()._step_bucket(sched)
        if sched.kind == "decode" and self.draft is not None and not self._dflash:
            # The draft's K - 1 steps past the step's last row read and write K/V there: room in the table.
            context = B.select_bucket(self.context_buckets,
                                      min(sched.max_seq_len + self.spec.k, self.context_buckets[-1]))
            name = self._graph_name("decode", size, context)
        if any(c.num_draft_tokens for c in sched.chunks):
            name = self._graph_name("verify", size, context)
        return size, context, name, padding

    def _run_prefill(self, chunks, num_tokens: int, num_context: int, masks: dict | None = None):
        def row_inputs(rows: int) -> tuple:
            s = self.sampling.graph_tensors([c.req_id for c in chunks], rows)
            out = tuple(self._t(s[k]) for k in ("temperature", "top_k", "top_p", "uniform"))
            if self._dflash:
                from vllm_neuron.worker.dflash import prefill_draft_tables

                out += (self._t(prefill_draft_tables(chunks, rows, -(-self.config.max_model_len // self.block_size))),)
            elif self.draft is not None:
                from vllm_neuron.worker.eagle3 import prefill_draft_inputs

                out += tuple(map(self._t, prefill_draft_inputs(chunks, num_tokens, self.sampling.all_tokens)))
            return out
        return self._prefill_graph(chunks, num_tokens, num_context, masks, row_inputs)

    def _run_decode(self, chunks, batch: int, context: int, masks: dict | None = None,
                    input_ids: torch.Tensor | None = None):
        x = build_decode_inputs(chunks, batch, context, self.block_size)
        s = self.sampling.graph_tensors([c.req_id for c in chunks], batch)
        groups = self._group_inputs(chunks, lambda c: build_decode_inputs(c, batch, context, self.block_size),
                                    "block_tables")
        with torch.inference_mode():
            ids = input_ids if input_ids is not None else self._t(x.input_ids)
            graph = self._graph("decode", batch, context)
            return graph(ids, self._t(x.positions), self._t(x.slot_mapping), self._t(x.block_tables),
                         self._t(self._bitmask(chunks, batch, masks or {})), self._t(s["temperature"]),
                         self._t(s["top_k"]), self._t(s["top_p"]), self._t(s["uniform"]),
                         *self._decode_extra(chunks, x), self.kv_caches, *groups)

    def _decode_extra(self, chunks, x) -> tuple:
        """Further decode-graph inputs after the sampling ones (a multimodal runner's)."""
        return ()

    def _run_verify(self, chunks, batch: int, context: int, masks: dict | None = None):
        x = build_verify_inputs(chunks, batch, self.spec.k, context // self.block_size, self.block_size)
        req_ids = [c.req_id for c in chunks]
        s = self.sampling.graph_tensors(req_ids, batch)
        acc, smp = self.spec.uniforms(self.sampling.states, req_ids, batch)
        groups = self._group_inputs(chunks, lambda c: build_verify_inputs(
            c, batch, self.spec.k, context // self.block_size, self.block_size), "block_tables")
        with torch.inference_mode():
            graph = self._graph("verify", batch, context)
            return graph(self._t(x.input_ids), self._t(x.positions), self._t(x.slot_mapping), self._t(x.block_tables),
                         self._t(x.draft_ids), self._t(x.num_drafts), self._t(self._verify_bitmask(chunks, batch, masks)),
                         self._t(s["temperature"]), self._t(s["top_k"]), self._t(s["top_p"]), self._t(acc),
                         self._t(smp), self.kv_caches, *groups)

    def _verify_bitmask(self, chunks, batch: int, masks: dict | None) -> np.ndarray | None:
        """[B * (1 + K), words]: a grammar request's masks at its verified positions, all-allowed elsewhere."""
        rows = self._bitmask(chunks, batch * (self.spec.k + 1), {})
        if rows is None and not masks:
            return None
        rows = rows if rows is not None else np.full((batch * (self.spec.k + 1), self._bitmask_words), -1, np.int32)
        for i, c in enumerate(chunks):
            m = (masks or {}).get(c.req_id)
            if m is not None:
                m = np.atleast_2d(m)
                start = i * (self.spec.k + 1)
                rows[start:start + m.shape[0]] = m
        return rows

    def _execute_verify(self, sched: SchedulerOutput, size: int, context: int):
        """A decode step with drafts: (sampled, logprobs); row i emits its accepted drafts and one more."""
        chunks = sched.chunks
        tokens, num_emitted, logits0, *dev_drafts = self._run_verify(chunks, size, context, sched.grammar_bitmask)
        req_ids, sampled, logprobs = self._finalize_rows(chunks, tokens[:, 0], logits0)
        emitted = num_emitted.tolist()
        rows = tokens.tolist()
        for i, rid in enumerate(req_ids):
            extra = rows[i][1:emitted[i]]  # rows without drafts (host-sampled ones included) emit one
            if extra:
                sampled[rid] = sampled[rid] + extra
                self.sampling.states[rid].output_token_ids.extend(extra)
        return sampled, logprobs, (dev_drafts or [None])[0]

    def _drafts(self, sched: SchedulerOutput, chunks, sampled: dict, dev_drafts) -> dict[str, list[int]]:
        """Next step's drafts: the draft head's rows (EAGLE3) or the n-gram proposer's, for the requests whose
        next step may use them (the scheduler leaves paused requests out)."""
        if self.spec is None:
            return {}
        wanted = [r for r in sampled if sched.spec_req_ids is None or r in sched.spec_req_ids]
        if dev_drafts is None:
            return self.spec.propose(self.sampling.states, wanted)
        rows = {c.req_id: i for i, c in enumerate(chunks) if c.sample}
        return self.spec.take(self.sampling.states, {r: rows[r] for r in wanted}, dev_drafts.tolist())

    # -- one step --------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._back_kv_pages(sched)
        for rid in sched.finished_req_ids:
            self.sampling.remove(rid)
        for rid, n in sched.preempted_req_ids.items():
            self.sampling.truncate(rid, n)
        for data in sched.new_requests:
            self.sampling.add(data)
        chunks = sched.chunks
        size, context, name, padding = self._step_bucket(sched)
        fallback = passed = False
        if name.startswith("verify"):
            sampled, logprobs, dev_drafts = self._execute_verify(sched, size, context)
            return ModelRunnerOutput(sampled, logprobs, bucket_name=name, num_padding=padding,
                                     spec_token_ids=self._drafts(sched, chunks, sampled, dev_drafts))
        if sched.kind == "prefill":
            tokens, logits, *dev_drafts = self._run_prefill(chunks, size, context, sched.grammar_bitmask)
        else:
            chunks, passed_ids, fallback = self.token_passing.resolve(chunks, size)
            passed = passed_ids is not None
            tokens, logits, *dev_drafts = self._run_decode(chunks, size, context, sched.grammar_bitmask, passed_ids)
        req_ids, sampled, logprobs = self._finalize_rows(chunks, tokens, logits)
        host_rows = any(self.sampling.states[r].on_host for r in req_ids)
        self.token_passing.record(sched.kind, [c.req_id for c in chunks], tokens,
                                  {r: t[0] for r, t in sampled.items()}, host_rows)
        return ModelRunnerOutput(sampled, logprobs, bucket_name=name, num_padding=padding,
                                 async_fallback=fallback, tokens_passed_on_device=passed,
                                 spec_token_ids=self._drafts(sched, chunks, sampled, (dev_drafts or [None])[0]))
