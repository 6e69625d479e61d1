"""The GGUF conversion cache: a second load of the same file reads configs, tokenizer and weights
from $VLLM_CACHE_ROOT/gguf instead of parsing and dequantizing the GGUF again."""

from __future__ import annotations

import glob
import logging
import os

import gguf
import pytest
import torch

from tests.model_factory import make_tiny_gguf
from vllm_neuron.model.loader import (
    gguf_cache,
    gguf_loader,
    load_checkpoint,
    load_tokenizer,
)
from vllm_neuron.model.loader import tokenizer as tokenizer_module

# No tokenizer metadata: GGUFReader opens these in milliseconds (the 49k vocabulary takes seconds).
SMALL = {"vocab_size": 512, "tokenizer": False}
TEXTS = [
    "Hello world, naïve café! 1234 + 5 = 1239",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand    runs   of spaces\n\n\n  and newlines  ",
    "日本語のテキスト 🤖🚀 ÀÉÎ",
    "<|endoftext|>",
    "",
]


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch) -> str:
    root = str(tmp_path / "cache_root")
    monkeypatch.setenv("VLLM_CACHE_ROOT", root)
    monkeypatch.delenv("VLLM_NEURON_GGUF_CACHE_MAX_GIB", raising=False)
    monkeypatch.setattr(gguf_cache, "_unusable_logged", set())
    return root


def _forget_in_process_caches() -> None:
    # What a fresh process would start without.
    gguf_loader._cached_reader.cache_clear()
    tokenizer_module._load_cached.cache_clear()


def _forbid_gguf_parsing(monkeypatch) -> None:
    _forget_in_process_caches()

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed although its conversion is cached")

    # Ours, and the one transformers' tokenizer conversion imports.
    monkeypatch.setattr(gguf_loader, "GGUFReader", refuse)
    monkeypatch.setattr(gguf, "GGUFReader", refuse)


def _reference_weights(path: str, dtype) -> list[tuple[str, torch.Tensor]]:
    """What the loader yields straight from the GGUF, bypassing the cache."""
    config = gguf_loader.gguf_config(path)
    return list(gguf_loader.iter_gguf_weights(path, config, dtype))


def _assert_same_weights(got: list, want: list) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def _entry(path: str) -> str:
    d = gguf_cache.cache_dir(path)
    assert d is not None
    return d


@pytest.mark.parametrize(
    "file_kw, dtypes",
    [
        ({"quant": "Q4_1"}, (torch.float32, torch.bfloat16)),
        ({"quant": "Q8_0"}, (None,)),
        ({"dtype": torch.float16}, (None, torch.bfloat16)),
    ],
    ids=["q4_1", "q8_0-native", "f16"],
)
def test_second_load_reads_the_cache_not_the_gguf(tmp_path, monkeypatch, cache_root, file_kw, dtypes):
    path = make_tiny_gguf(str(tmp_path / "m.gguf"), **SMALL, **file_kw)
    want = {dt: _reference_weights(path, dt) for dt in dtypes}
    first = load_checkpoint(path)
    for dt in dtypes:  # the first load yields the dequantized tensors and writes them
        _assert_same_weights(list(first.iter_weights(dt)), want[dt])
    entry = _entry(path)
    assert entry.startswith(os.path.join(cache_root, "gguf") + os.sep)
    for dt in dtypes:
        assert os.path.isfile(os.path.join(entry, gguf_cache.weights_file_name(dt)))

    _forbid_gguf_parsing(monkeypatch)
    second = load_checkpoint(path)
    assert second.path == path and second.is_gguf and second.tokenizer_path == path
    assert type(second.hf_config) is type(first.hf_config)
    assert second.hf_config.to_dict() == first.hf_config.to_dict()
    assert second.generation_config == first.generation_config
    for dt in dtypes:
        got = list(second.iter_weights(dt))
        _assert_same_weights(got, want[dt])
        assert second.weight_bytes(dt) == sum(t.nbytes for _, t in got) == first.weight_bytes(dt)


def test_cached_config_keeps_rope_scaling_and_untied_head(tmp_path, monkeypatch):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path = make_tiny_gguf(str(tmp_path / "r.gguf"), rope_scaling=rope, tie_word_embeddings=False, **SMALL)
    first = load_checkpoint(path)
    _forbid_gguf_parsing(monkeypatch)
    second = load_checkpoint(path)
    assert second.hf_config.to_dict() == first.hf_config.to_dict()
    assert second.hf_config.rope_parameters["rope_type"] == "llama3"
    assert second.hf_config.tie_word_embeddings is False


def test_tokenizer_from_the_cache_behaves_like_the_conversion(tmp_path, monkeypatch):
    path = make_tiny_gguf(str(tmp_path / "t.gguf"), num_hidden_layers=1)
    converted = load_tokenizer(path)
    assert os.path.isfile(os.path.join(_entry(path), gguf_cache.TOKENIZER_DIR, "tokenizer.json"))

    _forbid_gguf_parsing(monkeypatch)
    cached = load_tokenizer(path)
    assert cached is not converted and load_tokenizer(path) is cached  # per-process cache kept
    for text in TEXTS:
        ids = converted.encode(text)
        assert cached.encode(text) == ids, text
        assert cached(text, add_special_tokens=False)["input_ids"] == converted(
            text, add_special_tokens=False)["input_ids"], text
        assert cached.decode(ids) == converted.decode(ids)
        assert cached.decode(ids, skip_special_tokens=True) == converted.decode(ids, skip_special_tokens=True)
    assert cached.chat_template == converted.chat_template and cached.chat_template
    chat = [{"role": "user", "content": "Hi"}]
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "special_tokens_map", "name_or_path", "padding_side"):
        assert getattr(cached, attr) == getattr(converted, attr), attr
    assert len(cached) == len(converted) and cached.get_vocab() == converted.get_vocab()

    # The chat_template override still hands out a private copy.
    custom = load_tokenizer(path, chat_template="{{ messages[0]['content'] }}")
    assert custom.chat_template == "{{ messages[0]['content'] }}" and cached.chat_template != custom.chat_template


def test_corrupt_cached_tokenizer_is_converted_again(tmp_path):
    path = make_tiny_gguf(str(tmp_path / "t.gguf"), num_hidden_layers=1)
    want = load_tokenizer(path).encode(TEXTS[1])
    tok_json = os.path.join(_entry(path), gguf_cache.TOKENIZER_DIR, "tokenizer.json")
    with open(tok_json, "w") as f:
        f.write('{"not": "a tokenizer"')
    _forget_in_process_caches()
    assert load_tokenizer(path).encode(TEXTS[1]) == want
    with open(tok_json) as f:  # rewritten from the GGUF
        assert '"model"' in f.read()


def test_changed_file_does_not_read_the_stale_entry(tmp_path, cache_root):
    other = make_tiny_gguf(str(tmp_path / "other.gguf"), **SMALL)
    load_checkpoint(other)
    path = str(tmp_path / "m.gguf")
    make_tiny_gguf(path, quant="Q8_0", seed=0, **SMALL)
    old = load_checkpoint(path)
    old_weights = list(old.iter_weights(torch.bfloat16))
    old_entry = _entry(path)

    make_tiny_gguf(path, quant="Q8_0", seed=1, intermediate_size=96, **SMALL)  # other weights and size
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _forget_in_process_caches()
    new = load_checkpoint(path)
    assert _entry(path) != old_entry
    assert new.hf_config.intermediate_size == 96 != old.hf_config.intermediate_size
    got = list(new.iter_weights(torch.bfloat16))
    _assert_same_weights(got, _reference_weights(path, torch.bfloat16))
    assert not torch.equal(dict(got)["model.embed_tokens.weight"], dict(old_weights)["model.embed_tokens.weight"])
    # The entry of the replaced file version was dropped rather than left on disk; others stay.
    assert sorted(glob.glob(os.path.join(cache_root, "gguf", "*"))) == sorted([_entry(path), _entry(other)])


def test_truncated_weights_file_falls_back_and_is_rewritten(tmp_path):
    path = make_tiny_gguf(str(tmp_path / "m.gguf"), quant="Q4_1", **SMALL)
    want = _reference_weights(path, torch.bfloat16)
    list(load_checkpoint(path).iter_weights(torch.bfloat16))
    file = os.path.join(_entry(path), gguf_cache.weights_file_name(torch.bfloat16))
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size // 2)
    _forget_in_process_caches()
    ck = load_checkpoint(path)
    _assert_same_weights(list(ck.iter_weights(torch.bfloat16)), want)
    assert os.path.getsize(file) == size
    _assert_same_weights(list(ck.iter_weights(torch.bfloat16)), want)  # and the rewrite reads back


def test_weights_failing_midway_are_completed_from_the_gguf(tmp_path, monkeypatch):
    path = make_tiny_gguf(str(tmp_path / "m.gguf"), quant="Q4_1", **SMALL)
    want = _reference_weights(path, torch.float32)
    ck = load_checkpoint(path)
    list(ck.iter_weights(torch.float32))
    real = gguf_cache._iter_cached_weights

    def fails_after_three(file, dtype):
        for i, item in enumerate(real(file, dtype)):
            if i == 3:
                raise OSError("simulated read error")
            yield item

    monkeypatch.setattr(gguf_cache, "_iter_cached_weights", fails_after_three)
    got = list(ck.iter_weights(torch.float32))
    assert sorted(n for n, _ in got) == sorted(n for n, _ in want)  # each tensor exactly once
    ref = dict(want)
    for name, t in got:
        assert torch.equal(t, ref[name]), name


def test_corrupt_config_falls_back_to_the_gguf(tmp_path):
    path = make_tiny_gguf(str(tmp_path / "m.gguf"), **SMALL)
    want = load_checkpoint(path).hf_config.to_dict()
    with open(os.path.join(_entry(path), gguf_cache.CONFIG_NAME), "w") as f:
        f.write("{ truncated")
    _forget_in_process_caches()
    assert load_checkpoint(path).hf_config.to_dict() == want
    assert gguf_cache._read_configs(_entry(path))[0].to_dict() == want  # rewritten


@pytest.mark.parametrize("cap_gib", ["0", "0.00001"])
def test_size_cap_leaves_weights_uncached(tmp_path, monkeypatch, cap_gib):
    monkeypatch.setenv("VLLM_NEURON_GGUF_CACHE_MAX_GIB", cap_gib)
    path = make_tiny_gguf(str(tmp_path / "m.gguf"), quant="Q4_1", **SMALL)
    ck = load_checkpoint(path)
    assert ck.weight_bytes(torch.float32) > float(cap_gib) * 2**30
    _assert_same_weights(list(ck.iter_weights(torch.float32)), _reference_weights(path, torch.float32))
    entry = _entry(path)
    assert os.path.isfile(os.path.join(entry, gguf_cache.CONFIG_NAME))
    assert glob.glob(os.path.join(entry, "weights-*")) == []
    assert [n for n in os.listdir(entry) if ".tmp-" in n] == []


def test_negative_size_cap_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_GGUF_CACHE_MAX_GIB", "-1")
    with pytest.raises(ValueError, match="VLLM_NEURON_GGUF_CACHE_MAX_GIB"):
        gguf_cache.max_weight_bytes()


def test_unwritable_cache_root_still_loads(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache root should be")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(blocker))
    path = make_tiny_gguf(str(tmp_path / "m.gguf"), quant="Q8_0", **SMALL)
    want = _reference_weights(path, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="vllm_neuron"):
        for _ in range(2):
            _forget_in_process_caches()
            ck = load_checkpoint(path)
            assert ck.hf_config.vocab_size == 512
            _assert_same_weights(list(ck.iter_weights(torch.bfloat16)), want)
            assert ck.weight_bytes(torch.bfloat16) == sum(t.nbytes for _, t in want)
    notes = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    assert blocker.read_text() == "a file where the cache root should be"


def test_writes_are_logged_with_the_folder(tmp_path, caplog):
    path = make_tiny_gguf(str(tmp_path / "m.gguf"), quant="Q8_0", **SMALL)
    with caplog.at_level(logging.INFO, logger="vllm_neuron"):
        list(load_checkpoint(path).iter_weights(torch.bfloat16))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF conversion cached in")]
    assert any(_entry(path) in m and "weights-bfloat16.safetensors" in m for m in lines), lines
