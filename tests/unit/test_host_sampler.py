"""host_sample: vLLM sampling semantics on the host, checked against hand computations."""
import math

import pytest
import torch

from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.worker.host_sampler import HostSamplingRow, host_sample

V = 8


def row(params=None, prompt=(), output=(), uniform=0.5, min_tok_stops=None, bad_words=()):
    params = params or SamplingParams(temperature=0.0)
    if min_tok_stops is not None:  # EOS and the stop ids, as the worker sets them
        params._all_stop_token_ids = list(min_tok_stops)
    return HostSamplingRow(params, list(prompt), list(output), uniform, bad_words)


def greedy(logits, **kw):
    return host_sample(torch.tensor([logits], dtype=torch.float32), [row(**kw)]).token_ids[0]


def test_greedy_argmax_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(4, 50).to(torch.bfloat16)
    out = host_sample(logits, [row() for _ in range(4)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="num_rows"):
        host_sample(torch.zeros(2, V), [row()])


def test_repetition_penalty_prompt_and_output():
    logits = [2.0, 1.9, -0.5, -0.45, 0.0, 0.0, 0.0, 0.0]
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # No history: token 0 wins.
    assert greedy(logits, params=p) == 0
    # Token 0 seen in the prompt: 2.0 / 2 = 1.0 < 1.9 -> token 1.
    assert greedy(logits, params=p, prompt=[0]) == 1
    # Seen in the output counts the same way.
    assert greedy(logits, params=p, output=[0]) == 1
    # Both seen: 1.0 vs 0.95 -> token 0 again.
    assert greedy(logits, params=p, prompt=[1], output=[0]) == 0
    # Negative logits get multiplied: -0.45 * 2 = -0.9 < -0.5.
    neg = [-1.0, -1.0, -0.5, -0.45, -3.0, -3.0, -3.0, -3.0]
    assert greedy(neg, params=p) == 3
    assert greedy(neg, params=p, prompt=[3]) == 2


def test_frequency_and_presence_penalties_hand_computed():
    # Token 0 appears 3 times in the output, token 1 once, token 2 only in the prompt.
    base = [3.0, 2.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0]
    out = [0, 0, 0, 1]
    # frequency 0.4: t0 = 3 - 1.2 = 1.8; t1 = 2 - 0.4 = 1.6; t2 = 2.9 (prompt does not count) -> 2
    p = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    assert greedy(base, params=p, prompt=[2], output=out) == 2
    # presence 0.5 only: t0 = 2.5, t1 = 1.5, t2 = 2.9 -> 2; presence 0.05: t0 = 2.95 > 2.9 -> 0
    assert greedy(base, params=SamplingParams(temperature=0.0, presence_penalty=0.5), output=out) == 2
    assert greedy(base, params=SamplingParams(temperature=0.0, presence_penalty=0.05), output=out) == 0
    # frequency 0.03: t0 = 3 - 0.09 = 2.91 > 2.9 -> 0; 0.04: 2.88 < 2.9 -> 2 (counts, not presence)
    assert greedy(base, params=SamplingParams(temperature=0.0, frequency_penalty=0.03), output=out) == 0
    assert greedy(base, params=SamplingParams(temperature=0.0, frequency_penalty=0.04), output=out) == 2
    # Negative penalties encourage repetition.
    assert greedy([1.0, 2.0] + [0.0] * 6, params=SamplingParams(temperature=0.0, presence_penalty=-1.5),
                  output=[0]) == 0


def test_combined_penalties_flip_at_hand_computed_threshold():
    # Two candidates; after penalties the winner flips exactly at the hand-computed threshold.
    # t0 = 2.0 (seen in prompt and twice in output), rep 1.25, freq 0.1, pres 0.2:
    # 2.0 / 1.25 = 1.6; - 0.1 * 2 = 1.4; - 0.2 = 1.2.
    p = SamplingParams(temperature=0.0, repetition_penalty=1.25, frequency_penalty=0.1, presence_penalty=0.2)
    assert greedy([2.0, 1.199] + [-9.0] * 6, params=p, prompt=[0], output=[0, 0]) == 0
    assert greedy([2.0, 1.201] + [-9.0] * 6, params=p, prompt=[0], output=[0, 0]) == 1


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = [0.0, 0.0, 5.0, 4.0, 3.0, 0.0, 0.0, 0.0]  # 2 = EOS, 3 = a stop id
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert greedy(logits, params=p, output=[7], min_tok_stops=[2, 3]) == 4
    assert greedy(logits, params=p, output=[7, 7], min_tok_stops=[2, 3]) == 2


def test_logit_bias_and_allowed_token_ids():
    logits = [5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert greedy(logits, params=SamplingParams(temperature=0.0, logit_bias={1: 4.5})) == 1
    assert greedy(logits, params=SamplingParams(temperature=0.0, logit_bias={1: 3.5})) == 0
    assert greedy(logits, params=SamplingParams(temperature=0.0, allowed_token_ids=[3, 6])) == 3
    # Random sampling never leaves the allowed set.
    p = SamplingParams(temperature=1.0, allowed_token_ids=[3, 6], seed=0)
    toks = {host_sample(torch.zeros(1, V), [row(p, uniform=u / 50)]).token_ids[0] for u in range(50)}
    assert toks == {3, 6}


def test_bad_words_single_and_multi_token():
    logits = [0.0, 0.0, 0.0, 0.0, 9.0, 8.0, 7.0, 0.0]
    p = SamplingParams(temperature=0.0)
    assert greedy(logits, params=p, bad_words=[[4]]) == 5
    # [1, 5]: token 5 is banned only right after 1.
    assert greedy(logits, params=p, bad_words=[[4], [1, 5]], output=[3]) == 5
    assert greedy(logits, params=p, bad_words=[[4], [1, 5]], output=[3, 1]) == 6
    # Longer word: [2, 1, 6] bans 6 only after 2, 1.
    assert greedy([0.0] * 6 + [9.0, 0.0], params=p, bad_words=[[2, 1, 6]], output=[1]) == 6
    assert greedy([0.0] * 6 + [9.0, 1.0], params=p, bad_words=[[2, 1, 6]], output=[2, 1]) == 7


def _empirical(logits, params, n=4000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(logits))
    x = torch.tensor([logits])
    for _ in range(n):
        counts[host_sample(x, [row(params, uniform=float(torch.rand(1, generator=gen)))]).token_ids[0]] += 1
    return counts / n


def test_temperature_distribution():
    logits = [1.0, 0.5, 0.0, -1.0]
    freq = _empirical(logits, SamplingParams(temperature=0.5, seed=1))
    expected = torch.softmax(torch.tensor(logits) / 0.5, -1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_min_p_top_k_top_p_masks():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])).tolist()
    # min_p 0.3: threshold 0.12 keeps {0, 1, 2}.
    freq = _empirical(logits, SamplingParams(min_p=0.3, seed=1), n=2000)
    assert freq[3] == 0 and freq[4] == 0 and torch.allclose(freq[:3], torch.tensor([0.4, 0.3, 0.15]) / 0.85, atol=0.04)
    # top_k 2 keeps {0, 1}.
    freq = _empirical(logits, SamplingParams(top_k=2, seed=1), n=2000)
    assert freq[2:].sum() == 0 and abs(freq[0] - 4 / 7) < 0.04
    # top_p 0.7: 0.4 + 0.3 reaches 0.7 -> {0, 1}; top_p 0.71 needs token 2 too.
    assert _empirical(logits, SamplingParams(top_p=0.69, seed=1), n=1000)[2:].sum() == 0
    freq = _empirical(logits, SamplingParams(top_p=0.71, seed=1), n=2000)
    assert freq[2] > 0.1 and freq[3:].sum() == 0
    # top_p applies after top_k: top_k 3 then top_p 0.8 of the renormalized (0.47, 0.35, 0.18) -> {0, 1}
    assert _empirical(logits, SamplingParams(top_k=3, top_p=0.8, seed=1), n=1000)[2:].sum() == 0


def test_greedy_applies_processing_but_not_truncation():
    # Greedy row ignores min_p/top_k (reset by SamplingParams) but honours logit_bias.
    p = SamplingParams(temperature=0.0, logit_bias={3: 10.0})
    assert greedy([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], params=p) == 3


def test_row_token_depends_only_on_its_own_number_and_logits():
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=123)

    def run(batch_rows, target_pos, u):
        rows = [row(SamplingParams(temperature=1.0, top_p=0.5, min_p=0.05), uniform=0.3) for _ in range(batch_rows)]
        rows[target_pos] = row(p, uniform=u)
        x = logits[:batch_rows].clone()
        x[target_pos] = logits[0]
        return host_sample(x, rows).token_ids[target_pos]

    alone = [run(1, 0, u / 20) for u in range(20)]
    assert len(set(alone)) > 1  # really random
    assert [run(5, 3, u / 20) for u in range(20)] == alone
    assert [run(3, 1, u / 20) for u in range(20)] == alone


def test_logprobs_raw_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0, 0.5, 0.2, 0.1]])
    raw = torch.log_softmax(logits[0], -1)
    # Greedy with a logit_bias: logprobs stay those of the raw logits, as vLLM's raw_logprobs.
    p = SamplingParams(temperature=0.0, logprobs=2, logit_bias={4: 10.0})
    out = host_sample(logits, [row(p)])
    assert out.token_ids == [4]
    lp = out.logprobs[0]
    assert [t for t, _, _ in lp] == [4, 1, 2]
    assert [r for _, _, r in lp] == [8, 1, 2]
    for t, v, _ in lp:
        assert math.isclose(v, raw[t].item(), rel_tol=1e-6)
    # logprobs=0: the sampled token only.
    out = host_sample(logits, [row(SamplingParams(temperature=0.0, logprobs=0))])
    assert out.logprobs[0] == [(1, pytest.approx(raw[1].item()), 1)]
    # -1: the whole vocabulary after the sampled token.
    out = host_sample(logits.repeat(2, 1), [row(SamplingParams(temperature=0.0, logprobs=-1)), row()])
    assert len(out.logprobs[0]) == 1 + V and out.logprobs[1] is None


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(mode):
    """vLLM's four --logprobs-mode values, hand-computed: a greedy row with a logit bias (processed = biased
    logits) and a random row with temperature 0.5 and top_k 3 (processed = scaled, -inf outside the top 3)."""
    logits = torch.tensor([[1.0, 3.0, 0.5, 2.0, -1.0, 0.0, 0.2, 0.1]] * 2)
    greedy_row = row(SamplingParams(temperature=0.0, logprobs=2, logit_bias={0: 5.0}))
    random_row = row(SamplingParams(temperature=0.5, top_k=3, logprobs=2, seed=1), uniform=0.3)
    out = host_sample(logits.clone(), [greedy_row, random_row], logprobs_mode=mode)
    biased = logits[0].clone()
    biased[0] += 5.0
    scaled = logits[1] / 0.5
    truncated = torch.full_like(scaled, float("-inf"))
    top3 = scaled.topk(3).indices
    truncated[top3] = scaled[top3]
    want = {"raw_logprobs": (logits[0].log_softmax(-1), logits[1].log_softmax(-1)),
            "raw_logits": (logits[0], logits[1]),
            "processed_logprobs": (biased.log_softmax(-1), truncated.log_softmax(-1)),
            "processed_logits": (biased, truncated)}[mode]
    assert out.token_ids[0] == 0 and out.token_ids[1] in top3.tolist()
    for entries, ref, tok in zip(out.logprobs, want, out.token_ids):
        assert entries[0][0] == tok and entries[0][1] == pytest.approx(ref[tok].item(), abs=1e-5)
        assert entries[0][2] == int((ref >= ref[tok]).sum())
        best = ref.topk(2)
        assert [(t, round(v, 4)) for t, v, _ in entries[1:]] == \
            [(i, round(v, 4)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
