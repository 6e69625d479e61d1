"""A tiny random-weight Qwen3-VL (transformers' own config and model classes) with the SmolLM2 tokenizer
plus Qwen3-VL's vision special tokens, a Qwen-style chat template and a Qwen2-VL image processor config,
built locally; and transformers' greedy reference for prompts with images.

    from tests.vlm_factory import make_tiny_qwen3_vl, build_tiny_qwen3_vl, hf_greedy, random_image
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch

from tests.model_factory import BOS_ID, EOS_ID, SMOLLM2_VOCAB_SIZE, smollm2_tokenizer_dir

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (SMOLLM2_VOCAB_SIZE + i for i in range(4))
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB = SMOLLM2_VOCAB_SIZE + 8
PATCH, MERGE = 14, 2
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string -%}{{ message.content }}{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' or part.type == 'image_url' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'video' or part.type == 'video_url' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}{%- endif -%}<|im_end|>\n"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


def tiny_qwen3_vl_config(num_hidden_layers: int = 3, deepstack=(0, 1), **text_kw):
    from transformers import Qwen3VLConfig

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_hidden_layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                     mrope_interleaved=True),
                bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    text.update(text_kw)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=list(deepstack))
    return Qwen3VLConfig(architectures=["Qwen3VLForConditionalGeneration"], text_config=text, vision_config=vision,
                         image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                         vision_end_token_id=VISION_END, tie_word_embeddings=False)


def seed_weights_(model, seed: int):
    """Seeded unit-scale weights in place: norms around 1, biases around 0, embeddings N(0, 1), matrices
    scaled by their fan-in (so a deep random stack keeps its activations in range)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * noise)
            elif "embed" in name and p.ndim == 2:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))
    return model


@functools.lru_cache(maxsize=4)
def build_tiny_qwen3_vl(seed: int = 0, **kw):
    """transformers' Qwen3VLForConditionalGeneration with seeded unit-scale weights, fp32, eval mode."""
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    model = seed_weights_(Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(**kw)), seed)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    return model.eval()


def image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                    size={"shortest_edge": 28 * 28, "longest_edge": 224 * 224})


def make_tiny_qwen3_vl(path: str, **kw) -> str:
    """Writes the model, its tokenizer (with the vision tokens and chat template) and its image processor."""
    from transformers import AutoTokenizer

    os.makedirs(path, exist_ok=True)
    build_tiny_qwen3_vl(**kw).save_pretrained(path)
    src = smollm2_tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    assert tok.convert_tokens_to_ids(SPECIAL) == [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    image_processor().save_pretrained(path)
    return path


def random_image(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def expand(ids: list[int], grids) -> tuple[list[int], list[int]]:
    """Each image placeholder -> t*h*w/merge^2 copies; returns (ids, mm_token_type_ids)."""
    out, types, it = [], [], iter(grids)
    for t in ids:
        if t == IMAGE_PAD:
            g = next(it)
            n = int(g[0] * g[1] * g[2]) // MERGE ** 2
            out += [IMAGE_PAD] * n
            types += [1] * n
        else:
            out.append(t)
            types.append(0)
    return out, types


def hf_greedy(ids: list[int], images: list, max_new: int, **kw) -> list[int]:
    """transformers greedy tokens after `ids` (one IMAGE_PAD per image, expanded here)."""
    extra = {}
    grids = []
    if images:
        px = image_processor()(images=images, return_tensors="pt")
        grids = px["image_grid_thw"].tolist()
        extra = dict(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    full, types = expand(ids, grids)
    return hf_generate(full, types, max_new, **extra, **kw)


def hf_generate(full: list[int], types: list[int], max_new: int, seed: int = 0, **inputs) -> list[int]:
    """transformers greedy tokens after expanded ids `full` (mm_token_type_ids `types`) and model inputs."""
    model = build_tiny_qwen3_vl(seed=seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([full]), mm_token_type_ids=torch.tensor([types]), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=EOS_ID, **inputs)
    return out[0, len(full):].tolist()


def solid_image(h: int, w: int, color: tuple[int, int, int]):
    """One colour: unlike two noise images, it moves the tiny model's greedy tokens."""
    from PIL import Image

    return Image.new("RGB", (w, h), color)


def png_bytes(img) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    import base64

    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def mp4_bytes(num_frames: int, fps: int, size: int = 56) -> bytes:
    """An mpeg4 video of random frames, encoded with PyAV."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = size, size, "yuv420p"
        for i in range(num_frames):
            for p in s.encode(av.VideoFrame.from_ndarray(np.asarray(random_image(size, size, i)), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()
