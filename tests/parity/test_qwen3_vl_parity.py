"""Qwen3-VL greedy tokens against transformers on a tiny random-weight model (fp32): one image, two
images of different sizes, an image plus text turns, a prompt whose image is split across prefill
segments, all batched together; eager and compiled. The encoder cache serves a repeated image with
identical output; with prefix caching on, two prompts that differ only in their image share no KV."""
from __future__ import annotations

import pytest

from tests.model_factory import tiny_llm
from tests.vlm_factory import (IMAGE, data_url, hf_generate, hf_greedy, make_tiny_qwen3_vl, mp4_bytes, png_bytes,
                               random_image, solid_image)
from vllm_neuron import LLM, SamplingParams

pytestmark = pytest.mark.engine

MAX_NEW = 6
# Vision attention in blocks of 128 patches (56x56 = 16, 112x112 = 64), encoder buckets of 1 and 2 blocks.
ENCODER = {"encoder_attention_block_size": 128, "num_encoder_input_buckets": [128, 256]}
BUCKETS = {"neuron_config": {"num_batched_tokens_buckets": [16, 32], "num_seqs_buckets": [1, 4]},
           "encoder_neuron_config": ENCODER}
# (prompt text, images). 56x84 -> 6 tokens, 56x56 -> 4, 112x112 -> 16; max_num_batched_tokens=32 splits the
# long prompt's 112x112 image across two prefill segments.
CASES = [
    ("Look: " + IMAGE + " what is it?", [(56, 84)]),
    ("First " + IMAGE + " then " + IMAGE + " compare.", [(56, 56), (112, 112)]),
    ("<|im_start|>user\n" + IMAGE + "Describe.<|im_end|>\n<|im_start|>assistant\nA square.<|im_end|>\n"
     "<|im_start|>user\nAnd its colour?<|im_end|>\n<|im_start|>assistant\n", [(84, 56)]),
    ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " + IMAGE
     + " end", [(112, 112)]),
    # Three 64-patch images: two attention blocks, one encoder call in the 256-patch bucket.
    ("Three: " + IMAGE + IMAGE + IMAGE + ".", [(112, 112)] * 3),
]


def _images(sizes, seed0=0):
    return [random_image(h, w, seed0 + i) for i, (h, w) in enumerate(sizes)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl")))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(tokenizer) -> list[list[int]]:
    return [hf_greedy(tokenizer.encode(text), _images(sizes), MAX_NEW) for text, sizes in CASES]


def _engine(model_dir: str, **kw) -> LLM:
    return tiny_llm(model_dir, **{"max_num_seqs": 4, "num_gpu_blocks_override": 96, "enforce_eager": False,
                                  "additional_config": BUCKETS, **kw})


def _generate(llm: LLM, cases=CASES, seed0: int = 0):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [{"prompt": text, "multi_modal_data": {"image": _images(sizes, seed0)}} for text, sizes in cases]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def eager(model_dir) -> LLM:
    return _engine(model_dir, enforce_eager=True)


def test_eager_matches_transformers(eager, reference, tokenizer):
    segmented = tokenizer.encode(CASES[3][0])
    start = segmented.index(tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    assert start < 32 < start + 16  # the image spans the segment boundary
    assert _generate(eager) == reference


def test_encoder_groups_fit_the_largest_bucket(model_dir, reference):
    """With one 128-patch bucket the three images of the last case need two encoder calls."""
    llm = _engine(model_dir, enforce_eager=True, additional_config={**BUCKETS, "encoder_neuron_config": {
        "encoder_attention_block_size": 128, "num_encoder_input_buckets": [128]}})
    assert _generate(llm, CASES[-1:]) == reference[-1:]
    assert llm.llm_engine.core.runner.kinds[0].num_encoder_runs == 2


def test_encoder_cache_hit_gives_identical_output(eager, reference):
    runner = eager.llm_engine.core.runner
    runs, hits = runner.kinds[0].num_encoder_runs, runner.kinds[0].encoder_cache.hits
    assert _generate(eager, CASES[:1]) == reference[:1]
    assert runner.kinds[0].num_encoder_runs == runs and runner.kinds[0].encoder_cache.hits > hits


def test_segmented_prefill_encodes_the_image_once(eager, tokenizer):
    """The image spans two prefill segments: the first encodes it, the second takes it from the cache."""
    text, sizes = CASES[3]
    runner = eager.llm_engine.core.runner
    runs, hits = runner.kinds[0].num_encoder_runs, runner.kinds[0].encoder_cache.hits
    img = [solid_image(*sizes[0], (200, 30, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = eager.generate({"prompt": text, "multi_modal_data": {"image": img}}, params, use_tqdm=False)
    assert runner.kinds[0].num_encoder_runs == runs + 1 and runner.kinds[0].encoder_cache.hits == hits + 1
    assert out[0].outputs[0].token_ids == hf_greedy(tokenizer.encode(text), img, MAX_NEW)


def test_prompts_differing_only_in_image_share_no_kv(eager, tokenizer):
    text, sizes = CASES[3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = eager.generate({"prompt": text, "multi_modal_data": {"image": _images(sizes, 0)}}, params, use_tqdm=False)
    black = [solid_image(*sizes[0], (0, 0, 0))]
    other = eager.generate({"prompt": text, "multi_modal_data": {"image": black}}, params, use_tqdm=False)
    again = eager.generate({"prompt": text, "multi_modal_data": {"image": black}}, params, use_tqdm=False)
    assert other[0].num_cached_tokens == 0  # the text prefix is equal, the image is not
    assert again[0].num_cached_tokens > 0  # same image: its blocks are reused
    ref_other = hf_greedy(tokenizer.encode(text), black, MAX_NEW)
    assert other[0].outputs[0].token_ids == again[0].outputs[0].token_ids == ref_other
    assert first[0].outputs[0].token_ids != ref_other


def test_model_runner_v2_matches_transformers(model_dir, reference, monkeypatch):
    """Multimodal on Model Runner V2: the media state is a model-kind component both runners call; each
    decode row's M-RoPE delta lives in the slot state and is gathered inside the graph."""
    from vllm_neuron.worker.model_runner_v2 import ModelRunnerV2

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    llm = _engine(model_dir, enforce_eager=True)
    runner = llm.llm_engine.core.runner
    assert isinstance(runner, ModelRunnerV2) and "rope_delta" in runner.state.extras
    assert _generate(llm) == reference
    assert runner.kinds[0].num_encoder_runs > 0


def test_ngram_speculation_matches_transformers(model_dir, reference, monkeypatch):
    """Multimodal with n-gram speculation (MRv1): verification rows add their request's M-RoPE delta, so
    greedy output is unchanged. A random-weight model repeats nothing for the proposer to find, so the
    proposer is an oracle: each request's own continuation with its last draft replaced by junk, which
    makes every verification accept and reject."""
    from vllm_neuron.worker.spec_decode.ngram import NgramSpeculator

    def propose(self, states, req_ids, rows, graph_drafts):
        out = {}
        for rid in req_ids:
            done = states[rid].output_token_ids
            ref = next((r for r in reference if done and r[:len(done)] == done), None)
            if ref is not None and len(done) < len(ref):
                out[rid] = ref[len(done):len(done) + self.k - 1] + [5]
        return out
    monkeypatch.setattr(NgramSpeculator, "propose", propose)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = _engine(model_dir, enforce_eager=True, speculative_config=spec)
    assert _generate(llm) == reference
    stats = llm.llm_engine.core.scheduler.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.slow
def test_compiled_matches_transformers(model_dir, reference):
    # One prefill, one decode and one encoder bucket (two blocks of 128 patches): three graphs to compile.
    config = {"neuron_config": {"num_batched_tokens_buckets": [32], "num_seqs_buckets": [4]},
              "encoder_neuron_config": {"encoder_attention_block_size": 128, "num_encoder_input_buckets": [256]}}
    llm = _engine(model_dir, additional_config=config)
    assert [r.name for r in llm.llm_engine.core.compiler.records] == ["prefill_s32", "decode_b4", "encoder_p256"]
    assert _generate(llm) == reference
    # A second engine with the same configuration loads all three graphs, the encoder's included.
    again = _engine(model_dir, additional_config=config)
    assert again.llm_engine.core.compiler.num_compiled == 0
    assert _generate(again, CASES[:2]) == reference[:2]


def test_chat_with_image_content_parts(eager, tokenizer):
    """LLM.chat: an image_url data: URL and a PIL image part render through the chat template."""
    img = random_image(56, 84, 0)
    url = data_url(png_bytes(img))
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe."}]},
            {"role": "assistant", "content": "A square."},
            {"role": "user", "content": [{"type": "image", "image": solid_image(56, 56, (0, 0, 0))},
                                         {"type": "text", "text": "And this?"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = eager.chat(conv, params, use_tqdm=False)
    text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert text.count(IMAGE) == 2
    ref = hf_greedy(tokenizer.encode(text, add_special_tokens=False), [img, solid_image(56, 56, (0, 0, 0))], MAX_NEW)
    assert out[0].outputs[0].token_ids == ref
    with pytest.raises(ValueError, match="unknown modality 'audio'; valid modalities for this model: \\['image', 'video'\\]"):
        eager.chat([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": url}}]}], params)


def _check_video_against_transformers(eager, tokenizer, video, source_indices: list[int], fps: float):
    """Our tokens for one video prompt equal transformers' greedy ones on the same pixels, and the prompt
    holds <t seconds><|vision_start|><|video_pad|> x 4<|vision_end|> per frame pair, at transformers' pair
    timestamps of those source frames; returns the timestamps."""
    import torch
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    text = "Watch: <|vision_start|><|video_pad|><|vision_end|> what happens?"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = eager.generate({"prompt": text, "multi_modal_data": {"video": video}}, params, use_tqdm=False)
    ids, items = eager.llm_engine.input_processor.mm_processor.process(tokenizer.encode(text), {"video": video})
    stamps = Qwen3VLProcessor._calculate_timestamps(None, source_indices, fps, 2)
    layout = "".join(f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>" for t in stamps)
    assert layout in tokenizer.decode(ids)
    assert len(items) == 1 and items[0].grid_thw == (2, 4, 4) and len(items[0].runs) == 2
    types = [2 if t == tokenizer.convert_tokens_to_ids("<|video_pad|>") else 0 for t in ids]
    ref = hf_generate(ids, types, MAX_NEW, pixel_values_videos=torch.from_numpy(items[0].pixel_values),
                      video_grid_thw=torch.tensor([items[0].grid_thw]))
    assert out[0].outputs[0].token_ids == ref
    return stamps


def test_video_matches_transformers(eager, tokenizer):
    """Four frames without metadata (24 fps, as transformers assumes): two frame pairs."""
    import numpy as np

    frames = np.stack([np.asarray(random_image(56, 56, 10 + i)) for i in range(4)])
    _check_video_against_transformers(eager, tokenizer, frames, [0, 1, 2, 3], 24)


def test_video_file_is_decoded_and_sampled_at_fps(eager, tokenizer):
    """An mp4 (PyAV) at 4 fps, 8 frames, sampled at 2 fps: frames 0, 2, 4, 6 -> two frame pairs."""
    url = data_url(mp4_bytes(8, 4), "video/mp4")
    text = "<|vision_start|><|video_pad|><|vision_end|>"
    proc = eager.llm_engine.input_processor.mm_processor
    ids, items = proc.process(tokenizer.encode(text), {"video": url}, {"fps": 2})
    assert items[0].grid_thw == (2, 4, 4)
    assert "<0.2 seconds>" in tokenizer.decode(ids) and "<1.2 seconds>" in tokenizer.decode(ids)  # (0+.5)/2, (1+1.5)/2
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    out = eager.generate({"prompt": text, "multi_modal_data": {"video": url}}, params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="cannot decode the video"):
        proc.process(tokenizer.encode(text), {"video": data_url(b"not a video", "video/mp4")})


def test_language_model_only_serves_text_and_refuses_media(model_dir, eager, tokenizer):
    llm = _engine(model_dir, enforce_eager=True, additional_config={**BUCKETS, "mm_language_model_only": True})
    assert llm.llm_engine.core.runner.model.model.visual is None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    text = "A text-only question about colours"
    assert llm.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids == \
        eager.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="mm_language_model_only"):
        llm.generate({"prompt": CASES[0][0], "multi_modal_data": {"image": _images(CASES[0][1])}}, params)


def test_video_frames_and_metadata_tuple_matches_transformers(eager, tokenizer):
    """Seed 000's offline form {"video": (frames, metadata)}: one video whose frame pairs are timed by the
    metadata (frames 0, 5, 10, 15 of a 10 fps source), as transformers' Qwen3-VL processor times them."""
    import numpy as np

    frames = np.stack([np.asarray(random_image(56, 56, 30 + i)) for i in range(4)])
    video = (frames, {"fps": 10.0, "frames_indices": [0, 5, 10, 15], "total_num_frames": 20})
    assert _check_video_against_transformers(eager, tokenizer, video, [0, 5, 10, 15], 10.0) == [0.25, 1.25]


def test_seed_offline_example_configuration(model_dir):
    """Seed 000's Qwen3-VL offline example: neuron_config.quantization "bf16" means unquantized bfloat16
    weights and runs (its tensor_parallel_size=16 is a 32B model's; tensor parallelism of a vision model is
    tested in test_qwen3_vl_parallel.py)."""
    import torch

    bf16 = {**BUCKETS, "neuron_config": {**BUCKETS["neuron_config"], "quantization": "bf16"}}
    with pytest.raises(ValueError, match="quantization='bf16' asks for unquantized bfloat16 weights, but "
                                         "dtype='float32'"):
        _engine(model_dir, enforce_eager=True, additional_config=bf16)
    llm = _engine(model_dir, enforce_eager=True, dtype="auto", additional_config=bf16)
    config = llm.llm_engine.config
    assert (config.dtype, config.neuron_config.quantization) == ("bfloat16", None)
    assert llm.llm_engine.core.runner.model.model.language_model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.generate({"prompt": CASES[0][0], "multi_modal_data": {"image": _images(CASES[0][1])}},
                       SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == MAX_NEW
