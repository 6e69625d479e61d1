"""N-gram prompt lookup: longest suffix match, latest occurrence, up to k following tokens."""
from vllm_neuron.worker.spec_decode.ngram_proposer import propose_ngram


def test_proposes_the_tokens_after_the_matched_suffix():
    toks = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4]
    assert propose_ngram(toks, 2, 3, 2) == [5, 6]
    # Past the end of the history the copy continues from itself (period 8 here).
    assert propose_ngram(toks, 2, 3, 10) == [5, 6, 9, 9, 2, 3, 4, 5, 6, 9]


def test_longest_match_beats_a_later_shorter_one():
    # suffix [7, 8, 9]: full match at the start; only [8, 9] matches later.
    toks = [7, 8, 9, 100, 5, 8, 9, 200, 7, 8, 9]
    assert propose_ngram(toks, 1, 3, 1) == [100]
    assert propose_ngram(toks, 1, 2, 1) == [200]  # capped at 2: the latest [8, 9] wins


def test_latest_occurrence_wins_among_equal_lengths():
    toks = [4, 5, 10, 4, 5, 11, 4, 5]
    assert propose_ngram(toks, 2, 2, 1) == [11]


def test_no_match_or_too_short_gives_no_draft():
    assert propose_ngram([1, 2, 3, 4], 1, 3, 3) == []
    assert propose_ngram([1, 2, 1], 2, 3, 3) == []  # only a 1-gram matches
    assert propose_ngram([1], 1, 3, 3) == []
    assert propose_ngram([1, 1, 1, 1], 1, 3, 0) == []


def test_repetition_proposes_the_period():
    toks = [3, 4, 5] * 4
    assert propose_ngram(toks, 2, 4, 5) == [3, 4, 5, 3, 4]  # the latest match is one period back
    assert propose_ngram([9] * 6, 1, 3, 4) == [9, 9, 9, 9]
