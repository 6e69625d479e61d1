"""Beam search as vLLM builds it on the engine's generation: every step asks the engine for one token of each
live beam with its 2 x beam_width most likely next tokens (logprobs), keeps the beam_width best extensions of
each prompt by cumulative logprob, and sets aside beams that end with EOS; at the end the finished and live
beams are ranked by cumulative logprob / len(tokens) ** length_penalty (prompt included, as vLLM).
Each step's prompts are the beams' tokens, so the prefix cache serves what beams share (their KV blocks).

Pure bookkeeping: `LLM.beam_search` and the server's `use_beam_search` drive it with their own engine calls
(`BeamSearch`: the beams to extend, then the engine's logprobs for them, step by step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm_neuron.outputs import Logprob
from vllm_neuron.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and generated tokens
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None

    def score(self, eos_token_id: int | None, length_penalty: float) -> float:
        n = len(self.tokens) - (1 if self.tokens and self.tokens[-1] == eos_token_id else 0)
        return self.cum_logprob / (n ** length_penalty)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclass
class BeamSearchInstance:
    """One prompt's search."""

    prompt_len: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)

    @classmethod
    def start(cls, prompt_token_ids: list[int]) -> BeamSearchInstance:
        return cls(len(prompt_token_ids), [BeamSearchSequence(list(prompt_token_ids))])

    def extend(self, step_logprobs: list[dict[int, Logprob]], params: BeamSearchParams,
               eos_token_id: int | None) -> None:
        """The step's candidates of each live beam (step_logprobs[i]: beam i's next-token logprobs)."""
        new = []
        for beam, candidates in zip(self.beams, step_logprobs):
            for token, lp in candidates.items():
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [candidates],
                                         beam.cum_logprob + lp.logprob)
                if token == eos_token_id and not params.ignore_eos:
                    seq.finish_reason = "stop"
                    self.completed.append(seq)
                else:
                    new.append(seq)
        new.sort(key=lambda s: s.score(eos_token_id, params.length_penalty), reverse=True)
        self.beams = new[:params.beam_width]

    def retire_full(self, max_model_len: int) -> None:
        """Beams with no room for another token end here ("length")."""
        full = [b for b in self.beams if len(b.tokens) >= max_model_len]
        for b in full:
            b.finish_reason = "length"
        self.completed += full
        self.beams = [b for b in self.beams if len(b.tokens) < max_model_len]

    def best(self, params: BeamSearchParams, eos_token_id: int | None) -> list[BeamSearchSequence]:
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        done = sorted(self.completed + self.beams, key=lambda s: s.score(eos_token_id, params.length_penalty),
                      reverse=True)
        return done[:params.beam_width]



class BeamSearch:
    """The search over a list of prompts, one engine step at a time:
        while (beams := search.next_step()) is not None:
            search.advance(<each beam's next-token logprobs, from generating beams with search.step_params>)
        search.results()
    """

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                 max_model_len: int) -> None:
        self.params = params
        self.step_params = params.step_params()
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.instances = [BeamSearchInstance.start(p) for p in prompts]
        self.steps = 0

    def next_step(self) -> list[list[int]] | None:
        """The token lists of the live beams to extend, None when the search is over."""
        if self.steps >= self.params.max_tokens:
            return None
        for inst in self.instances:
            inst.retire_full(self.max_model_len)
        live = [b.tokens for inst in self.instances for b in inst.beams]
        return live or None

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        i = 0
        for inst in self.instances:
            n = len(inst.beams)
            inst.extend(step_logprobs[i:i + n], self.params, self.eos_token_id)
            i += n
        self.steps += 1

    def results(self) -> list[list[BeamSearchSequence]]:
        return [inst.best(self.params, self.eos_token_id) for inst in self.instances]
