"""A GGUF split into llama.cpp's `-0000i-of-0000N` parts (written by gguf-py's writer, as gguf-split names and
keys them) loads like the same model in one file; a missing or renamed part is an error naming it."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.model_factory import make_tiny_gguf
from vllm_neuron.model.loader import load_checkpoint
from vllm_neuron.model.loader.gguf_cache import cache_dir

KW = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
          vocab_size=512, tokenizer=False, seed=11, quant="Q8_0")
PARTS = ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    whole = make_tiny_gguf(str(root / "whole" / "m.gguf"), **KW)
    first = make_tiny_gguf(str(root / "split" / "m.gguf"), split_max_tensors=8, **KW)
    return whole, first


def _copy_without(first: str, dest: str, leave_out: str) -> str:
    os.makedirs(dest)
    for name in PARTS:
        if name != leave_out:
            shutil.copy(os.path.join(os.path.dirname(first), name), dest)
    return dest


def test_split_gguf_loads_like_the_whole_file(files):
    whole, first = files
    folder = os.path.dirname(first)
    assert sorted(os.listdir(folder)) == PARTS and first == os.path.join(folder, PARTS[0])
    ref = load_checkpoint(whole)
    want = dict(ref.iter_weights(torch.float32))
    # The first part, the folder, or a later part: all read the three parts from the first one.
    for given in (first, folder, os.path.join(folder, PARTS[2])):
        ck = load_checkpoint(given)
        assert ck.gguf_file == first and ck.hf_config.to_dict() == ref.hf_config.to_dict()
        assert ck.gguf_files == [os.path.join(folder, n) for n in PARTS]  # e.g. the KV tier's key stats them all
        got = dict(ck.iter_weights(torch.float32))
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
        assert ck.weight_bytes(torch.float32) == ref.weight_bytes(torch.float32)


@pytest.mark.parametrize("leave_out", [PARTS[1], PARTS[2]])
def test_a_missing_part_is_named(files, tmp_path, leave_out):
    folder = _copy_without(files[1], str(tmp_path / "parts"), leave_out)
    for given in (os.path.join(folder, PARTS[0]), folder):
        with pytest.raises(ValueError, match=f"split into 3 parts, and {leave_out} is missing"):
            load_checkpoint(given)


def test_a_missing_first_part_is_named(files, tmp_path):
    folder = _copy_without(files[1], str(tmp_path / "parts"), PARTS[0])
    for given in (os.path.join(folder, PARTS[1]), folder):
        with pytest.raises(ValueError, match=f"first part {PARTS[0]} .* is missing"):
            load_checkpoint(given)


def test_a_renamed_first_part_is_refused(files, tmp_path):
    renamed = str(tmp_path / "model.gguf")
    shutil.copy(files[1], renamed)
    with pytest.raises(ValueError, match="first of 3 parts .* does not end with -00001-of-00003.gguf"):
        load_checkpoint(renamed)


def test_the_conversion_cache_key_covers_every_part(files, tmp_path):
    folder = str(tmp_path / "parts")
    shutil.copytree(os.path.dirname(files[1]), folder)
    first, last = os.path.join(folder, PARTS[0]), os.path.join(folder, PARTS[2])
    before = cache_dir(first)
    st = os.stat(last)
    os.utime(last, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a re-downloaded last part
    assert before is not None and cache_dir(first) not in (None, before)
