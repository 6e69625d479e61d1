"""Qwen3-VL pieces against transformers on the tiny random model (fp32): the vision tower with the
host preprocessing (one and two images, padded to a bucket), M-RoPE positions and delta, and the
checkpoint loading (vision Conv3d flattened, text q/k/v fused)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.vlm_factory import IMAGE_PAD, MERGE, build_tiny_qwen3_vl, expand, image_processor, random_image
from vllm_neuron.model.qwen3_vl import Qwen3VLForConditionalGeneration
from vllm_neuron.model.qwen3_vl.mrope import VisionRun, mrope_positions, rope_positions_for
from vllm_neuron.model.qwen3_vl.preprocessing import vision_inputs


@pytest.fixture(scope="module")
def models():
    hf = build_tiny_qwen3_vl()
    ours = Qwen3VLForConditionalGeneration(hf.config)
    ours.load_weights(hf.state_dict().items())
    return hf, ours.eval()


def _pixels(sizes):
    out = image_processor()(images=[random_image(h, w, i) for i, (h, w) in enumerate(sizes)], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("sizes", [[(56, 56)], [(56, 84), (112, 112)]])
@pytest.mark.parametrize("pad", [0, 40])
def test_vision_tower_matches_transformers(models, sizes, pad):
    hf, ours = models
    pixels, grid = _pixels(sizes)
    with torch.no_grad():
        ref = hf.model.get_image_features(pixels, grid)
        grids = [tuple(g) for g in grid.tolist()]
        counts = [t * h * w for t, h, w in grids]
        x = vision_inputs(ours.mm_arch.vision, list(pixels.split(counts)), grids, num_patches=sum(counts) + pad)
        embeds, deepstack = ours.encode(*x.tensors())
    n = sum(counts) // MERGE ** 2
    torch.testing.assert_close(embeds[:n], torch.cat(ref.pooler_output), atol=1e-5, rtol=1e-5)
    assert deepstack.shape[0] == 2
    for ours_ds, ref_ds in zip(deepstack, ref.deepstack_features):
        torch.testing.assert_close(ours_ds[:n], torch.cat(ref_ds), atol=1e-5, rtol=1e-5)


def test_mrope_positions_match_transformers(models):
    hf, _ = models
    _, grid = _pixels([(56, 84), (112, 112)])
    ids = [5, 6, IMAGE_PAD, 7, 8, 9, IMAGE_PAD, 10]
    full, types = expand(ids, grid.tolist())
    ref, ref_delta = hf.model.get_rope_index(torch.tensor([full]), torch.tensor([types]), image_grid_thw=grid)
    runs, i = [], 0
    for g in grid.tolist():
        i = full.index(IMAGE_PAD, i)
        llm = (g[0], g[1] // MERGE, g[2] // MERGE)
        runs.append(VisionRun(i, llm))
        i += int(np.prod(llm))
    pos, delta = mrope_positions(len(full), runs)
    np.testing.assert_array_equal(pos, ref[:, 0].numpy())
    assert delta == int(ref_delta) and delta < 0  # images advance the rotary position less than their tokens
    # Decode continues at p + delta on every axis; prompt positions come from the table.
    seq = np.array([1, len(full), len(full) + 3])
    out = rope_positions_for(seq, pos, delta)
    np.testing.assert_array_equal(out[:, 0], pos[:, 1])
    assert (out[:, 1:] == (seq[1:] + delta)[None]).all()


def test_mrope_refuses_overlapping_runs():
    with pytest.raises(ValueError, match="overlaps"):
        mrope_positions(10, [VisionRun(0, (1, 2, 2)), VisionRun(2, (1, 2, 2))])


def test_language_model_only_skips_the_vision_tower():
    hf = build_tiny_qwen3_vl()
    ours = Qwen3VLForConditionalGeneration(hf.config, language_model_only=True)
    ours.load_weights(hf.state_dict().items())
    assert ours.model.visual is None
    with pytest.raises(ValueError, match="text tower only"):
        ours.encode(*[None] * 5)
