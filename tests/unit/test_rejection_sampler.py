"""The in-graph rejection sampler: greedy acceptance, and random acceptance whose emitted tokens follow
the target distribution exactly (chi-square over many draws)."""
import pytest
import torch

from vllm_neuron.model.layers.rejection_sampler import rejection_sample


def _params(b, temperature=1.0, top_k=0, top_p=1.0):
    return (torch.full((b,), temperature), torch.full((b,), top_k, dtype=torch.int64), torch.full((b,), top_p))


def _greedy(logits, drafts, num_drafts):
    b, k1, _ = logits.shape
    t, k, p = _params(b, temperature=0.0)
    return rejection_sample(logits, drafts, num_drafts, t, k, p, torch.rand(b, k1 - 1), torch.rand(b, k1))


def test_greedy_accepts_up_to_first_mismatch_then_emits_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 4, 50)  # K = 3
    am = logits.argmax(-1)
    drafts = am[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % 50  # row 1: mismatch at draft 2
    drafts[2, 0] = (drafts[2, 0] + 1) % 50  # row 2: mismatch at draft 1
    num = torch.tensor([3, 3, 3, 2])  # row 3: only two real drafts
    for all_greedy in (False, True):
        b, k1, _ = logits.shape
        t, k, p = _params(b, temperature=0.0)
        out, n = rejection_sample(logits, drafts, num, t, k, p, torch.rand(b, 3), torch.rand(b, 4),
                                  all_greedy=all_greedy)
        assert n.tolist() == [4, 2, 1, 3]
        assert out[0].tolist() == am[0].tolist()  # all 3 accepted + bonus argmax at position 3
        assert out[1].tolist() == [am[1, 0], am[1, 1], -1, -1]
        assert out[2].tolist() == [am[2, 0], -1, -1, -1]
        assert out[3].tolist() == [am[3, 0], am[3, 1], am[3, 2], -1]


def test_no_drafts_is_a_plain_greedy_step():
    logits = torch.randn(3, 3, 20)
    out, n = _greedy(logits, torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    assert n.tolist() == [1, 1, 1]
    assert out[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of zero target probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Bound for 11 degrees of freedom at p = 1e-6 (the tests draw with fixed seeds; this only guards the
# math, and a wrong residual lands orders of magnitude above it).
CHI2_BOUND = 52.0
V = 12


def _target():
    torch.manual_seed(3)
    logits = torch.randn(V) * 1.5
    return logits, torch.softmax(logits, -1)


def test_one_hot_draft_first_token_follows_the_target():
    logits, p = _target()
    n, k = 40000, 2
    draft = int(p.argmax())  # a likely draft: accepted often, so the residual matters a lot
    lg = logits.expand(n, k + 1, V).contiguous()
    drafts = torch.full((n, k), draft)
    t, tk, tp = _params(n)
    g = torch.Generator().manual_seed(11)
    out, emitted = rejection_sample(lg, drafts, torch.full((n,), k), t, tk, tp,
                                    torch.rand(n, k, generator=g), torch.rand(n, k + 1, generator=g))
    assert _chi2(out[:, 0], p) < CHI2_BOUND
    # After an accepted first draft the second token again follows the target.
    second = out[emitted >= 2, 1]
    assert _chi2(second, p) < CHI2_BOUND
    accept_rate = float((out[:, 0] == draft).double().mean())
    assert abs(accept_rate - float(p[draft])) < 0.02


def test_a_wrong_residual_fails_the_bound():
    """Resampling from p (not the residual) after a rejection skews the distribution: the bound sees it."""
    _, p = _target()
    draft = int(p.argmax())
    wrong = (1 - p[draft]) * p  # accept d w.p. p(d), else draw from p again
    wrong[draft] += p[draft]
    g = torch.Generator().manual_seed(12)
    samples = torch.multinomial(wrong, 40000, replacement=True, generator=g)
    assert _chi2(samples, p) > 10 * CHI2_BOUND


def test_draft_distribution_residual_follows_the_target():
    logits, p = _target()
    torch.manual_seed(4)
    q = torch.softmax(torch.randn(V), -1)
    n = 40000
    g = torch.Generator().manual_seed(13)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
    t, tk, tp = _params(n)
    out, _ = rejection_sample(logits.expand(n, 2, V).contiguous(), drafts, torch.ones(n, dtype=torch.int64),
                              t, tk, tp, torch.rand(n, 1, generator=g), torch.rand(n, 2, generator=g),
                              draft_probs=q.expand(n, 1, V))
    assert _chi2(out[:, 0], p) < CHI2_BOUND


def test_draft_equal_to_target_is_always_accepted():
    logits, p = _target()
    n = 2000
    g = torch.Generator().manual_seed(14)
    drafts = torch.multinomial(p, n, replacement=True, generator=g)[:, None]
    t, tk, tp = _params(n)
    _, emitted = rejection_sample(logits.expand(n, 2, V).contiguous(), drafts, torch.ones(n, dtype=torch.int64),
                                  t, tk, tp, torch.rand(n, 1, generator=g), torch.rand(n, 2, generator=g),
                                  draft_probs=p.expand(n, 1, V))
    assert emitted.min() == 2


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.6)])
def test_filtered_target_rejects_drafts_outside_the_kept_set(top_k, top_p):
    logits, p = _target()
    order = torch.argsort(p, descending=True)
    kept = order[:3] if top_k else order[:int((torch.cumsum(p[order], 0) < top_p).sum()) + 1]
    target = torch.zeros(V)
    target[kept] = p[kept] / p[kept].sum()
    n = 30000
    draft = int(order[-1])  # the least likely token: outside top-k / top-p
    t, tk, tp = _params(n, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(15)
    out, emitted = rejection_sample(logits.expand(n, 2, V).contiguous(), torch.full((n, 1), draft),
                                    torch.ones(n, dtype=torch.int64), t, tk, tp,
                                    torch.rand(n, 1, generator=g), torch.rand(n, 2, generator=g))
    assert emitted.max() == 1
    assert _chi2(out[:, 0], target) < CHI2_BOUND
