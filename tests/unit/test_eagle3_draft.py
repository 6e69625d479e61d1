"""EAGLE3 draft checkpoints: config.json reading, the default taps, and the start-up errors of a draft that
does not fit the target (each names the problem)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_factory import SMOLLM2_VOCAB_SIZE, make_tiny_eagle3
from vllm_neuron.model.eagle3 import load_eagle3_draft, read_eagle3_config
from vllm_neuron.model.eagle3.config import default_aux_layers

V = SMOLLM2_VOCAB_SIZE


def _load(path, **kw):
    args = dict(dtype=torch.float32, device=torch.device("cpu"), target_vocab=V, target_hidden=64, max_positions=64)
    return load_eagle3_draft(path, **{**args, **kw})


def test_reads_the_checkpoint_and_maps_draft_ids(tmp_path):
    path = make_tiny_eagle3(str(tmp_path / "d"), draft_vocab_size=512, aux_layer_ids=[0, 1, 1])
    model, nbytes = _load(path)
    assert model.cfg.draft_vocab_size == 512 and model.cfg.aux_layers(2) == (0, 1, 1)
    assert model.embed_tokens is None and nbytes > 0  # no embedding of its own: the target's is used
    step = V // 512
    assert model.d2t[5].item() + 5 == 5 * step  # draft id i -> target id i * step
    out = model.draft_tokens(torch.randn(4, 64))
    assert ((out % step) == 0).all() and (out < V).all()


def test_default_taps_and_their_validation(tmp_path):
    assert default_aux_layers(32) == (2, 16, 29)
    cfg = read_eagle3_config(make_tiny_eagle3(str(tmp_path / "d")))
    assert cfg.aux_layers(8) == (2, 4, 5)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids=\[2, 1, -1\] must be three layer"):
        cfg.aux_layers(2)


def _edit(path, cfg=None, drop=None, reshape=None):
    if cfg:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        c.update(cfg)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f)
    if drop or reshape:
        file = os.path.join(path, "model.safetensors")
        st = load_file(file)
        if drop:
            del st[drop]
        if reshape:
            st[reshape] = torch.zeros(3, 3)
        save_file(st, file)
    return path


@pytest.mark.parametrize("edit, kw, match", [
    (dict(cfg={"architectures": ["LlamaForCausalLM"]}), {}, "is not an EAGLE3 draft"),
    (dict(cfg={"num_hidden_layers": 2}), {}, "only single-layer EAGLE3"),
    (dict(cfg={"hidden_size": 0}), {}, "hidden_size must be a positive integer"),
    ({}, dict(target_hidden=128), "trained on target hidden size 64, the target has 128"),
    ({}, dict(target_vocab=1000), "do not fit the target vocabulary"),
    (dict(drop="midlayer.mlp.up_proj.weight"), {}, r"lacks tensors \['midlayer.mlp.up_proj.weight'\]"),
    (dict(drop="d2t"), {}, "has no d2t map"),
    (dict(reshape="fc.weight"), {}, r"tensor 'fc.weight' has shape \(3, 3\)"),
    (dict(reshape="extra.weight"), {}, r"unexpected tensors \['extra.weight'\]"),
])
def test_bad_draft_checkpoints_are_refused(tmp_path, edit, kw, match):
    path = _edit(make_tiny_eagle3(str(tmp_path / "d")), **edit)
    with pytest.raises(ValueError, match=match):
        _load(path, **kw)


def test_missing_draft_directory(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        _load(str(tmp_path / "nothing"))
