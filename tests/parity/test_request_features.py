"""What a request can ask for beyond sampling, against transformers on the default tiny Llama (fp32):
prompt logprobs (segmented prefill, a prompt whose blocks are cached), prompt embeddings, --logprobs-mode
(every mode is checked by hand in tests/unit/test_host_sampler.py; here one through the engine), a custom
logits processor, beam search.

One engine for the module: tiny buckets, so a 70-token prompt is prefilled in three segments.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.model_factory import build_tiny_llama, greedy_reference, tiny_llm
from vllm_neuron import SamplingParams
from vllm_neuron.sampling_params import BeamSearchParams
from vllm_neuron.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm_neuron.worker.builtin_logits_processors import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                          MinTokensLogitsProcessor)

pytestmark = pytest.mark.engine

LONG = [(7 * i + 3) % 4000 + 5 for i in range(70)]  # over max_num_batched_tokens (32): three segments
SHORT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.fixture(scope="module")
def hf():
    return build_tiny_llama().eval()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # processed_logprobs: sampled tokens' logprobs after temperature and top-k (prompt logprobs stay raw).
    return tiny_llm(tiny_llama_dir, enable_prompt_embeds=True, logprobs_mode="processed_logprobs")


def _hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def _check_prompt_logprobs(plp, ids: list[int], ref: torch.Tensor, top: int) -> None:
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        step, tok = plp[p], ids[p]
        want = ref[p - 1]
        assert abs(step[tok].logprob - want[tok].item()) < 1e-4, p
        assert step[tok].rank == int((want >= want[tok]).sum())
        best = torch.topk(want, top)
        by_rank = {lp.rank: (t, lp.logprob) for t, lp in step.items()}
        for r in range(top):
            t, lp = by_rank[r + 1]
            assert t == best.indices[r].item() and abs(lp - best.values[r].item()) < 1e-4


def test_prompt_logprobs_match_transformers(llm, hf):
    """Segmented prefill (LONG), a batch of two such requests, then the same prompt again after a plain
    request filled the prefix cache with it: the hit is refused, every position computed again."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": LONG}, {"prompt_token_ids": SHORT}], sp, use_tqdm=False)
    for out, ids in zip(outs, (LONG, SHORT)):
        _check_prompt_logprobs(out.prompt_logprobs, ids, _hf_prompt_logprobs(hf, ids), 3)
    llm.generate([{"prompt_token_ids": LONG}], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": LONG}], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    _check_prompt_logprobs(again.prompt_logprobs, LONG, _hf_prompt_logprobs(hf, LONG), 3)


def test_prompt_logprobs_leave_other_requests_alone(llm, hf):
    """Greedy requests submitted with prompt-logprobs ones get transformers' tokens; a plain prompt served
    from the cache after them too."""
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": SHORT}, {"prompt_token_ids": LONG}, {"prompt_token_ids": LONG[:40]}],
                        [plain, scored, plain], use_tqdm=False)
    ref = greedy_reference(hf, [SHORT, LONG, LONG[:40]], 6)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[0].prompt_logprobs is None and len(outs[1].prompt_logprobs) == len(LONG)
    assert all(len(step) == 1 for step in outs[1].prompt_logprobs[1:])  # prompt_logprobs=0: the token only


def test_prompt_logprobs_above_the_cap_are_refused(llm):
    with pytest.raises(ValueError, match="prompt logprobs of 21.*max allowed: 20"):
        llm.generate("hi", SamplingParams(max_tokens=1, prompt_logprobs=21), use_tqdm=False)


def _embeds(hf, ids: list[int]) -> torch.Tensor:
    return hf.model.embed_tokens.weight[ids].detach().clone()


def test_prompt_embeds_equal_their_token_ids(llm, hf):
    """Embeddings taken from the model's table give the token ids' greedy tokens and transformers'
    inputs_embeds generate, segmented prefill included; the same embeddings again hit the prefix cache."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_embeds": _embeds(hf, LONG)}, {"prompt_token_ids": SHORT},
                         {"prompt_embeds": _embeds(hf, SHORT)}], greedy, use_tqdm=False)
    with torch.no_grad():
        ref = [hf.generate(inputs_embeds=_embeds(hf, ids)[None], max_new_tokens=6, min_new_tokens=6,
                           do_sample=False, pad_token_id=2)[0].tolist() for ids in (LONG, SHORT)]
    assert outs[0].outputs[0].token_ids == ref[0] == greedy_reference(hf, [LONG], 6)[0]
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids == ref[1]
    again = llm.generate([{"prompt_embeds": _embeds(hf, LONG)}], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 64 and again.outputs[0].token_ids == ref[0]
    other = _embeds(hf, LONG)
    other[-1] += 0.5  # other bytes, another prefix-cache key
    assert llm.generate([{"prompt_embeds": other}], greedy, use_tqdm=False)[0].num_cached_tokens == 0


@pytest.mark.parametrize("embeds, match", [
    (torch.zeros(4, 7), r"shape \[seq_len, 64\]"),
    (torch.zeros(4, 64, dtype=torch.int64), "float32, bfloat16 or float16"),
    (torch.full((4, 64), float("nan")), "NaN or infinite"),
    ([[0.0] * 64], "must be a torch.Tensor"),
])
def test_bad_prompt_embeds_are_refused(llm, embeds, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_embeds": embeds}], SamplingParams(max_tokens=1), use_tqdm=False)


def test_processed_logprobs_mode(llm, hf):
    sp = SamplingParams(temperature=0.5, top_k=3, seed=7, max_tokens=4, logprobs=2, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": SHORT}], sp, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([SHORT + out.token_ids])).logits[0, len(SHORT) - 1:-1].float()
    for step, tok, lg in zip(out.logprobs, out.token_ids, logits):
        top3 = (lg / 0.5).topk(3).indices
        truncated = torch.full_like(lg, float("-inf"))
        truncated[top3] = lg[top3] / 0.5
        ref = truncated.log_softmax(-1)
        assert tok in top3.tolist() and abs(step[tok].logprob - ref[tok].item()) < 1e-4


class BanToken(LogitsProcessor):
    """Bans the token a request names in extra_args["ban"] (vLLM's DummyLogitsProcessor pattern)."""

    def __init__(self, config, device, is_pin_memory) -> None:
        self.ban: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    @classmethod
    def validate_params(cls, params) -> None:
        ban = (params.extra_args or {}).get("ban")
        if ban is not None and not isinstance(ban, int):
            raise ValueError(f"extra_args['ban'] must be a token id, got {ban!r}")

    def update_state(self, update: BatchUpdate | None) -> None:
        if update is None:
            return
        for i in update.removed:
            self.ban.pop(i, None)
        for i, params, _, _ in update.added:
            self.ban.pop(i, None)
            if (params.extra_args or {}).get("ban") is not None:
                self.ban[i] = params.extra_args["ban"]
        for a, b, how in update.moved:
            moved, other = self.ban.pop(a, None), self.ban.pop(b, None)
            if moved is not None:
                self.ban[b] = moved
            if how == MoveDirectionality.SWAP and other is not None:
                self.ban[a] = other

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, token in self.ban.items():
            logits[i, token] = float("-inf")
        return logits


class _FromExtraArgs:
    """A built-in processor taking its option from extra_args[OPTION] instead of the field of that name."""
    OPTION = ""

    def row_state(self, params, prompt_token_ids, output_token_ids):
        value = (params.extra_args or {}).get(self.OPTION)
        if value is None:
            return None
        return super().row_state(dataclasses.replace(params, **{self.OPTION: value}), prompt_token_ids,
                                 output_token_ids)


class MinTokensFromExtraArgs(_FromExtraArgs, MinTokensLogitsProcessor):
    OPTION = "min_tokens"


class LogitBiasFromExtraArgs(_FromExtraArgs, LogitBiasLogitsProcessor):
    OPTION = "logit_bias"


class MinPFromExtraArgs(_FromExtraArgs, MinPLogitsProcessor):
    OPTION = "min_p"


@pytest.fixture(scope="module")
def llm_lp(tiny_llama_dir):
    return tiny_llm(tiny_llama_dir, logits_processors=[BanToken, MinTokensFromExtraArgs, LogitBiasFromExtraArgs,
                                                       MinPFromExtraArgs])


def test_builtin_options_behave_identically_as_custom_processors(llm_lp, hf):
    """min_tokens, logit_bias and min_p asked the built-in way and through custom processors (the built-in
    classes reading extra_args, loaded with logits_processors=) give the same tokens, greedy and seeded."""
    free = greedy_reference(hf, [SHORT], 6)[0]
    base = dict(max_tokens=6, stop_token_ids=[free[0]])
    cases = [
        ({"min_tokens": 4}, dict(temperature=0.0)),  # free[0] stops the request at once unless held back
        ({"logit_bias": {free[1]: 8.0, 77: 3.0}}, dict(temperature=0.0, ignore_eos=True)),
        ({"min_p": 0.4}, dict(temperature=1.7, seed=5, ignore_eos=True)),
        ({"min_p": 0.4}, dict(temperature=0.6, seed=11, ignore_eos=True)),
    ]
    changed = 0
    for option, kw in cases:
        kw = {**base, **kw} if "min_tokens" in option else {**kw, "max_tokens": 6}
        plain = SamplingParams(**kw)
        builtin = SamplingParams(**kw, **option)
        custom = SamplingParams(**kw, extra_args=option)
        outs = llm_lp.generate([{"prompt_token_ids": SHORT}] * 3, [plain, builtin, custom], use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        assert tokens[1] == tokens[2], (option, kw, tokens)
        changed += tokens[0] != tokens[1]
    assert changed >= 3  # the options changed the output (min_p may keep one seed's draw)


def test_custom_logits_processor_bans_a_token(llm_lp, hf):
    llm = llm_lp
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    free = greedy_reference(hf, [SHORT], 5)[0]
    banned = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, extra_args={"ban": free[0]})
    outs = llm.generate([{"prompt_token_ids": SHORT}] * 3, [greedy, banned, greedy], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == free
    got = outs[1].outputs[0].token_ids
    with torch.no_grad():
        first = hf(torch.tensor([SHORT])).logits[0, -1]
    first[free[0]] = float("-inf")
    assert free[0] not in got and got[0] == int(first.argmax())
    with pytest.raises(ValueError, match="must be a token id"):
        llm.generate("hi", SamplingParams(max_tokens=1, extra_args={"ban": "x"}), use_tqdm=False)


def _hf_beams(hf, prompt: list[int], width: int, new: int):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, early_stopping=True, length_penalty=1.0,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=2)
    return [s[len(prompt):].tolist() for s in out.sequences], (out.sequences_scores * new).tolist()


def test_beam_search_equals_transformers(llm, hf):
    width, new = 3, 5
    outs = llm.beam_search([{"prompt_token_ids": SHORT}, {"prompt_token_ids": LONG[:20]}],
                           BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True))
    for prompt, out in zip((SHORT, LONG[:20]), outs):
        ref_tokens, ref_sums = _hf_beams(hf, prompt, width, new)
        assert [s.tokens[len(prompt):] for s in out.sequences] == ref_tokens
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(ref_sums, abs=1e-4)
        assert all(s.tokens[:len(prompt)] == prompt and s.finish_reason == "length" for s in out.sequences)


def test_model_runner_v2_prompt_logprobs_and_embeds(tiny_llama_dir, hf, monkeypatch):
    """The module's engine runs MRv1 (eager); MRv2 (forced) takes the same inputs through its slot graphs."""
    from vllm_neuron.worker.model_runner_v2 import ModelRunnerV2

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    llm = tiny_llm(tiny_llama_dir, enable_prompt_embeds=True)
    assert isinstance(llm.llm_engine.core.runner, ModelRunnerV2)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": LONG}, {"prompt_embeds": _embeds(hf, SHORT)}, {"prompt_token_ids": SHORT}],
                        [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2), greedy,
                         greedy], use_tqdm=False)
    _check_prompt_logprobs(outs[0].prompt_logprobs, LONG, _hf_prompt_logprobs(hf, LONG), 2)
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference(hf, [LONG, SHORT, SHORT], 6)
