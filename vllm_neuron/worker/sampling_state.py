"""Per-request sampling state on the worker, and the split between in-graph and host sampling.

Rows whose parameters the in-graph sampler covers (greedy / temperature / top-k / top-p) take the
graph's token; rows that need more (penalties, min_p, logit bias, min_tokens, logprobs, bad words,
allowed tokens) or all rows under CPU sampling go through `host_sample` on the graph's logits.
Every request holds a 32-bit seed (its own, folded, or one drawn from the engine's seeded generator
when it has none) and each token's random number is `counter_uniform(seed, position)` on every path,
so a request's tokens depend neither on its batch neighbours nor on which path sampled them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_neuron.config.neuron_config import OnDeviceSamplingConfig
from vllm_neuron.model.layers.in_graph_sampler import counter_uniform, fold_seed
from vllm_neuron.logger import init_logger
from vllm_neuron.sampling_params import SAMPLING_EPS
from vllm_neuron.step import NewRequestData, StepLogprobs
from vllm_neuron.worker.host_sampler import HostSamplingRow, host_sample
from vllm_neuron.worker.logits_processors import LogitsProcessorBatch

logger = init_logger(__name__)


@dataclass
class RequestState:
    data: NewRequestData
    seed: int  # 32 bits, folded (counter_uniform's input)
    output_token_ids: list[int] = field(default_factory=list)
    on_host: bool = False

    @property
    def next_position(self) -> int:
        """Position of the token sampled next (what its random number is drawn for)."""
        return len(self.data.prompt_token_ids) + len(self.output_token_ids)

    @property
    def params(self):
        return self.data.sampling_params


class SamplingStates:
    def __init__(self, odsc: OnDeviceSamplingConfig | None, seed: int, logprobs_mode: str = "raw_logprobs",
                 processors: LogitsProcessorBatch | None = None, use_kernels: bool = False) -> None:
        """processors: the custom logits processors (--logits-processors); every request is then host-sampled;
        use_kernels: the host's draw takes the graphs' CPU sampling kernel (the engine's KernelConfig.sampler)."""
        self.odsc = odsc
        self.use_kernels = use_kernels
        self.logprobs_mode = logprobs_mode
        self.processors = processors
        self.rng = torch.Generator().manual_seed(seed)
        self.states: dict[str, RequestState] = {}
        if odsc is not None and not odsc.all_greedy:
            # Said once here: a per-request warning fired on the bundled model's own default (top_p 0.9).
            logger.info("In-graph sampling draws from the %d most likely tokens (neuron_config."
                        "on_device_sampling_config.top_k), top_p with top_k off included, in the graph and on the "
                        "host alike; a request with a larger top_k samples on the host; on_device_sampling_config "
                        "null gives top-p over the full vocabulary", odsc.top_k)

    def add(self, data: NewRequestData) -> None:
        p = data.sampling_params
        seed = fold_seed(p.seed) if p.seed is not None else int(
            torch.randint(0, 1 << 32, (1,), generator=self.rng).item())
        # A top_k wider than the graph's top-k width would be silently narrowed: sample it on the host.
        on_host = self.odsc is None or p.needs_host_sampling or p.top_k > self.odsc.top_k or \
            self.processors is not None
        if p._all_stop_token_ids is None:
            # min_tokens holds EOS back even with ignore_eos (vLLM's all_stop_token_ids).
            eos = [] if data.eos_token_id is None else [data.eos_token_id]
            p._all_stop_token_ids = list(dict.fromkeys([*p.stop_token_ids, *eos]))
        st = self.states[data.req_id] = RequestState(data, seed, on_host=on_host)
        if self.processors is not None:
            self.processors.add(data.req_id, p, data.prompt_token_ids, st.output_token_ids)

    def truncate(self, req_id: str, num_output_tokens: int) -> None:
        """Forgets samples the scheduler dropped (a preempted request's step in flight)."""
        st = self.states.get(req_id)
        if st is not None:
            del st.output_token_ids[num_output_tokens:]

    def all_tokens(self, req_id: str) -> list[int]:
        """The request's prompt and output tokens known on the worker."""
        st = self.states[req_id]
        return st.data.prompt_token_ids + st.output_token_ids

    def remove(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        if self.processors is not None:
            self.processors.remove(req_id)

    def graph_tensors(self, req_ids: list[str], rows: int) -> dict[str, np.ndarray]:
        """Per-row sampling inputs of the graph; padded rows are greedy."""
        temp = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int64)
        top_p = np.ones(rows, np.float32)
        uniform = np.zeros(rows, np.float32)
        if self.odsc is None or self.odsc.all_greedy:
            return {"temperature": temp, "top_k": top_k, "top_p": top_p, "uniform": uniform}
        rows_in_graph = []
        for i, rid in enumerate(req_ids):
            st = self.states[rid]
            p = st.params
            if st.on_host or p.temperature < SAMPLING_EPS:
                continue
            temp[i], top_k[i], top_p[i] = p.temperature, self.odsc.effective_top_k(p.top_k), p.top_p
            rows_in_graph.append(i)
        if rows_in_graph:
            uniform[rows_in_graph] = self.uniforms([req_ids[i] for i in rows_in_graph]).numpy()
        return {"temperature": temp, "top_k": top_k, "top_p": top_p, "uniform": uniform}

    def uniforms(self, req_ids: list[str]) -> torch.Tensor:
        """[N] float32: each request's random number for the token it samples next."""
        sts = [self.states[r] for r in req_ids]
        return counter_uniform(torch.tensor([s.seed for s in sts], dtype=torch.int64),
                               torch.tensor([s.next_position for s in sts], dtype=torch.int64))

    def finalize(self, req_ids: list[str], graph_tokens: torch.Tensor | None, logits: torch.Tensor,
                 rows: list[int] | None = None) -> tuple[dict[str, list[int]], dict[str, StepLogprobs]]:
        """Tokens for the requests in req_ids, host-sampling the ones that need it. Request i's token and
        logits are at row rows[i] of graph_tokens / logits (default i). Only host-sampled rows of the logits
        are gathered: copying all of them ([16, 49152] fp32 at decode_b16) cost ~0.5-2 ms a step for nothing."""
        rows = list(range(len(req_ids))) if rows is None else rows
        host_rows = [i for i, rid in enumerate(req_ids) if self.states[rid].on_host]
        if graph_tokens is not None:
            all_tokens = graph_tokens.tolist()
            tokens = [all_tokens[r] for r in rows]
        else:
            tokens = [None] * len(req_ids)
        logprobs: dict[str, StepLogprobs] = {}
        if host_rows:
            host_inputs = []
            uniforms = self.uniforms([req_ids[i] for i in host_rows]).tolist()
            for i, u in zip(host_rows, uniforms):
                st = self.states[req_ids[i]]
                p = st.params
                host_inputs.append(HostSamplingRow(p, st.data.prompt_token_ids, st.output_token_ids, u,
                                                   p._bad_words_token_ids or ()))
            res = host_sample(logits[[rows[i] for i in host_rows]].float().cpu(), host_inputs,
                              max_top_k=self.odsc.top_k if self.odsc is not None else None,
                              logprobs_mode=self.logprobs_mode, use_kernels=self.use_kernels,
                              custom=None if self.processors is None else
                              lambda x, invariant: self.processors.apply(x, [req_ids[i] for i in host_rows],
                                                                         invariant))
            for j, i in enumerate(host_rows):
                tokens[i] = res.token_ids[j]
                if res.logprobs[j] is not None:
                    logprobs[req_ids[i]] = StepLogprobs(res.logprobs[j])
        sampled = {}
        for rid, tok in zip(req_ids, tokens):
            self.states[rid].output_token_ids.append(tok)
            sampled[rid] = [tok]
        return sampled, logprobs
