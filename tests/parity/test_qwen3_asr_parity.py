"""Qwen3-ASR against transformers on a tiny random-weight model (fp32): the audio encoder alone within
1e-4; greedy tokens for a short clip, a clip needing two attention windows and both in one batch (eager,
and once compiled); a checkpoint with a misshapen tensor is refused naming it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.asr_factory import (RATE, asr_prompt, build_tiny_qwen3_asr, feature_extractor, hf_asr_greedy,
                               hf_audio_inputs, make_tiny_qwen3_asr, tone)
from tests.model_factory import tiny_llm
from vllm_neuron import SamplingParams

MAX_NEW = 6
# One 104-token window per block; buckets of 2 and 4 blocks (a 9.3 s clip takes 2, both clips 3).
ENCODER = {"encoder_attention_block_size": 128, "num_encoder_input_buckets": [2, 4]}
BUCKETS = {"neuron_config": {"num_batched_tokens_buckets": [32], "num_seqs_buckets": [1, 4]},
           "encoder_neuron_config": ENCODER}
CLIPS = [tone(2.0, 300.0), tone(9.3, 520.0, seed=1)]  # 2 s: one window; 9.3 s: two windows (800 frames each)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_qwen3_asr(str(tmp_path_factory.mktemp("qwen3_asr")))


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).encode(asr_prompt("English"))


@pytest.fixture(scope="module")
def reference(prompt_ids) -> list[list[int]]:
    return [hf_asr_greedy(prompt_ids, c, MAX_NEW) for c in CLIPS]


def _generate(llm, clips) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [{"prompt": asr_prompt("English"), "multi_modal_data": {"audio": (c, RATE)}} for c in clips]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_audio_encoder_matches_transformers():
    from vllm_neuron.model.qwen3_asr.features import audio_blocks, log_mel
    from vllm_neuron.model.qwen3_asr.model import Qwen3ASRForConditionalGeneration

    hf = build_tiny_qwen3_asr()
    ours = Qwen3ASRForConditionalGeneration(hf.config).eval()
    ours.load_weights(hf.state_dict().items())
    mels = [log_mel(feature_extractor(), c) for c in CLIPS]
    blocks = audio_blocks(ours.mm_arch.audio, mels, 4)  # both clips in one padded bucket
    with torch.no_grad():
        got = ours.encode_audio(blocks.mel, blocks.chunk_len)[blocks.token_rows]
        want = torch.cat([hf.get_audio_features(**hf_audio_inputs(c)).pooler_output for c in CLIPS])
    assert got.shape == want.shape and got.shape[0] == 26 + 121
    assert (got - want).abs().max().item() < 1e-4


def test_misshapen_tensor_is_named(tmp_path):
    from vllm_neuron.model.qwen3_asr.model import Qwen3ASRForConditionalGeneration

    hf = build_tiny_qwen3_asr()
    state = dict(hf.state_dict())
    state["model.audio_tower.conv_out.weight"] = state["model.audio_tower.conv_out.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"model\.audio_tower\.conv_out\.weight.*shape"):
        Qwen3ASRForConditionalGeneration(hf.config).load_weights(state.items())


@pytest.mark.engine
def test_eager_matches_transformers(model_dir, reference):
    llm = tiny_llm(model_dir, max_num_seqs=4, num_gpu_blocks_override=96, enforce_eager=True,
                   additional_config=BUCKETS)
    runner = llm.llm_engine.core.runner
    assert [_generate(llm, [c])[0] for c in CLIPS] == reference  # one at a time
    runs = runner.kinds[0].num_encoder_runs
    assert _generate(llm, [tone(1.0, 700.0, seed=2)] + CLIPS)[1:] == reference  # batched, with a new clip
    assert runner.kinds[0].num_encoder_runs == runs + 1  # the new clip; the others from the encoder cache
    assert runner.kinds[0].encoder_cache.hits >= 2


@pytest.mark.engine
def test_compiled_batch_matches_transformers(model_dir, reference):
    llm = tiny_llm(model_dir, max_num_seqs=2, num_gpu_blocks_override=96, enforce_eager=False,
                   additional_config={"neuron_config": {"num_batched_tokens_buckets": [32], "num_seqs_buckets": [2]},
                                      "encoder_neuron_config": {**ENCODER, "num_encoder_input_buckets": [4]}})
    assert _generate(llm, CLIPS) == reference
    assert np.isfinite(reference).all()
