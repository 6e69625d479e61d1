"""DFlash draft checkpoints: both config layouts (z-lab's / vLLM's and speculators'), the taps, and the start-up
errors of a draft or K that does not fit the target (each names the problem)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_factory import SMOLLM2_VOCAB_SIZE, make_tiny_dflash
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.model.dflash import load_dflash_draft, read_dflash_config

V = SMOLLM2_VOCAB_SIZE


def _load(path, **kw):
    args = dict(dtype=torch.float32, device=torch.device("cpu"), target_vocab=V, target_hidden=64, target_layers=2,
                k=3, max_positions=64)
    return load_dflash_draft(path, **{**args, **kw})


@pytest.mark.parametrize("speculators", [False, True])
def test_both_layouts_read_the_same_draft(tmp_path, speculators):
    path = make_tiny_dflash(str(tmp_path / "d"), target_layer_ids=[0, 1], speculators=speculators)
    cfg = read_dflash_config(path)
    # DFlash's target_layer_ids are layer outputs: tapped as the inputs of the next layers (1, 2 = the last output)
    assert cfg.aux_layers(2) == (1, 2) and cfg.mask_token_id == 7 and cfg.block_size == 8 and cfg.num_layers == 2
    model, nbytes = _load(path)
    assert model.lm_head is None and model.embed_tokens is None and nbytes > 0  # the target's are borrowed
    assert model.kv_cache_specs() == [(2, 16), (2, 16)]
    EngineArgs.from_kwargs(speculative_config={"method": "dflash", "model": path, "num_speculative_tokens": 4})


def _edit(path, cfg=None, dflash=None, drop=None, add=None):
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c.update(cfg or {})
    c["dflash_config"].update(dflash or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    if drop or add:
        file = os.path.join(path, "model.safetensors")
        st = load_file(file)
        if drop:
            del st[drop]
        if add:
            st[add] = torch.zeros(3)
        save_file(st, file)
    return path


@pytest.mark.parametrize("edit, kw, match", [
    (dict(cfg={"architectures": ["LlamaForCausalLM"]}), {}, "is not a DFlash draft"),
    (dict(cfg={"hidden_size": None}), {}, "hidden_size must be a positive integer"),
    (dict(dflash={"target_layer_ids": []}), {}, "target layers to tap are missing"),
    (dict(dflash={"mask_token_id": None}), {}, "mask_token_id .* must be a non-negative integer"),
    (dict(dflash={"mask_token_id": V}), {}, f"mask_token_id {V} is outside the target vocabulary"),
    (dict(dflash={"target_layer_ids": [0, 5]}), {}, r"taps \[1, 6\] .* must lie in 0..2"),
    (dict(cfg={"layer_types": ["sliding_attention", "full_attention"]}), {}, "sliding-window draft layers"),
    (dict(dflash={"causal": True}), {}, "causal draft layers"),
    (dict(cfg={"num_target_layers": 36}), {}, "trained on a target of 36 layers"),
    ({}, dict(target_hidden=128), "trained on target hidden size 64, the target has 128"),
    ({}, dict(target_vocab=1000), "do not fit the target vocabulary"),
    ({}, dict(k=8), r"num_speculative_tokens=8 is larger .* block_size 8 .* choose 1..7"),
    (dict(drop="layers.1.self_attn.k_norm.weight"), {}, r"lacks tensors \['layers.1.self_attn.k_norm.weight'\]"),
    (dict(add="extra.weight"), {}, r"unexpected tensors \['extra.weight'\]"),
])
def test_bad_drafts_are_refused(tmp_path, edit, kw, match):
    path = _edit(make_tiny_dflash(str(tmp_path / "d")), **edit)
    with pytest.raises(ValueError, match=match):
        _load(path, **kw)


def test_missing_directory_and_mask_embedding_file(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        _load(str(tmp_path / "nothing"))
    path = make_tiny_dflash(str(tmp_path / "d"))
    torch.save(torch.zeros(64), os.path.join(path, "mask_embedding.pt"))
    with pytest.raises(ValueError, match="mask_embedding.pt is not supported yet"):
        _load(path)
