"""Qwen3-VL over two tensor-parallel ranks, its vision tower split by encoder_neuron_config: encoder TP=2
(heads and MLP rows sharded, partial sums all-reduced) and encoder DP=2 (each rank encodes half of a call's
blocks, gathered): greedy fp32 tokens equal transformers' (what TP=1 gives, test_qwen3_vl_parity.py) for
images of two sizes, several images in one prompt, an image split across prefill segments and a video."""
from __future__ import annotations

import numpy as np
import pytest

from tests.model_factory import tiny_llm
from tests.parity.test_qwen3_vl_parity import (BUCKETS, CASES, ENCODER, MAX_NEW, _check_video_against_transformers,
                                               _generate, _images)
from tests.vlm_factory import hf_greedy, make_tiny_qwen3_vl, random_image

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl_tp")))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("encoder, local_heads, dp", [({"tp_size": 2}, 1, 1), ({"dp_size": 2}, 2, 2)],
                         ids=["encoder_tp2", "encoder_dp2"])
def test_encoder_parallel_matches_transformers(model_dir, tokenizer, encoder, local_heads, dp):
    llm = tiny_llm(model_dir, tensor_parallel_size=2, max_num_seqs=4, num_gpu_blocks_override=96,
                   enforce_eager=True, additional_config={**BUCKETS, "encoder_neuron_config": {**ENCODER, **encoder}})
    try:
        runner = llm.llm_engine.core.runner.runner  # rank 0's runner inside the TP executor
        visual = runner.model.model.visual
        # The split is in force: this rank holds its share of the vision heads, and DP's buckets are whole
        # blocks for each rank (128 -> 256 patches with two).
        assert visual.blocks[0].attn.num_heads == local_heads and visual.vp.dp == dp
        assert runner.kinds[0].encoder_buckets == ([256] if dp == 2 else [128, 256])
        reference = [hf_greedy(tokenizer.encode(text), _images(sizes), MAX_NEW) for text, sizes in CASES]
        assert _generate(llm) == reference
        frames = np.stack([np.asarray(random_image(56, 56, 10 + i)) for i in range(4)])
        _check_video_against_transformers(llm, tokenizer, frames, [0, 1, 2, 3], 24)
    finally:
        llm.llm_engine.shutdown()


def test_encoder_split_must_cover_the_ranks(model_dir):
    with pytest.raises(ValueError, match="tp_size \\* dp_size must equal world_size: tp_size=2 \\* dp_size=2 = 4 "
                                         "!= world_size=2"):
        tiny_llm(model_dir, tensor_parallel_size=2,
                 additional_config={**BUCKETS, "encoder_neuron_config": {**ENCODER, "tp_size": 2, "dp_size": 2}})
