"""Qwen3-VL pieces against transformers on the tiny random model (fp32): the vision tower with the
host preprocessing (one and two images, padded to a bucket), M-RoPE positions and delta, and the
checkpoint loading (vision Conv3d flattened, text q/k/v fused)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.vlm_factory import IMAGE_PAD, MERGE, build_tiny_qwen3_vl, expand, image_processor, random_image
from vllm_neuron.model.qwen3_vl import Qwen3VLForConditionalGeneration
from vllm_neuron.model.qwen3_vl.block_packing import check_buckets, pack_ffd
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


@pytest.mark.parametrize("sizes, pad, block", [
    ([(56, 56)], 0, None), ([(56, 84), (112, 112)], 40, None),
    # Block-packed: 64 | 24 + 16 in two blocks of 64, a third block all padding.
    ([(56, 56), (56, 84), (112, 112)], 88, 64)])
def test_vision_tower_matches_transformers(models, sizes, pad, block):
    hf, ours = models
    pixels, grid = _pixels(sizes)
    with torch.no_grad():
        ref = hf.model.get_image_features(pixels, grid)
        grids = [tuple(g) for g in grid.tolist()]
        counts = [t * h * w for t, h, w in grids]
        x = vision_inputs(ours.mm_arch.vision, list(pixels.split(counts)), grids, num_patches=sum(counts) + pad,
                          block_size=block)
        embeds, deepstack = ours.encode(*x.tensors())
    assert x.segment.shape == ((sum(counts) + pad) // block, block) if block else (1, sum(counts) + pad)
    rows = x.token_rows
    torch.testing.assert_close(embeds[rows], torch.cat(ref.pooler_output), atol=1e-5, rtol=1e-5)
    assert deepstack.shape[0] == 2
    for ours_ds, ref_ds in zip(deepstack, ref.deepstack_features):
        torch.testing.assert_close(ours_ds[rows], torch.cat(ref_ds), atol=1e-5,
                                   rtol=1e-5)


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


def test_ffd_packs_largest_first_into_the_first_block_with_room():
    assert pack_ffd([16, 24, 64, 40], 64) == [[2], [3, 1], [0]]
    assert pack_ffd([16, 16, 16, 16], 64) == [[0, 1, 2, 3]]
    assert pack_ffd([], 64) == []
    with pytest.raises(ValueError, match="65 patches does not fit encoder_attention_block_size=64"):
        pack_ffd([65], 64)


def test_encoder_buckets_are_whole_blocks():
    assert check_buckets([512, 256, 512], 128) == [256, 512]
    with pytest.raises(ValueError, match="must be multiples of encoder_attention_block_size=128"):
        check_buckets([192], 128)


def test_packing_too_many_blocks_is_refused():
    from tests.vlm_factory import tiny_qwen3_vl_config
    from vllm_neuron.model.qwen3_vl.config import VisionArchConfig

    cfg = VisionArchConfig.from_hf(tiny_qwen3_vl_config().vision_config)
    grids = [(1, 6, 8), (1, 6, 8), (1, 4, 8)]  # 128 patches that need 3 blocks of 64
    px = [torch.zeros(t * h * w, cfg.patch_dim) for t, h, w in grids]
    with pytest.raises(ValueError, match="need 3 blocks of 64 patches; the bucket has 2"):
        vision_inputs(cfg, px, grids, num_patches=128, block_size=64)
