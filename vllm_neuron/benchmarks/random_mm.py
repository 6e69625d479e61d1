"""`bench serve --dataset-name random-mm`: random text prompts (the random dataset's) with random images
and videos of configured sizes, sent as data: URLs in chat content parts (vLLM's options and meaning).

`--random-mm-bucket-config '{(512, 512, 1): 0.5, (1024, 1024, 1): 0.5}'` maps (height, width, frames) to a
probability: frames 1 is an image (PNG), more is a video (an mp4 of that many random frames at 1 fps).
Each request gets base items +- the range ratio (uniform), capped per modality by
--random-mm-limit-mm-per-prompt. The prompt length counts text tokens only: the server adds the media tokens.
"""
from __future__ import annotations

import argparse
import ast
import base64
import io
import json
from typing import Any

import numpy as np

from vllm_neuron.benchmarks.prompts import SampleRequest, sample_random_requests

DEFAULT_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}"
DEFAULT_LIMITS = '{"image": 255, "video": 0}'


def add_random_mm_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("random-mm dataset options")
    g.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                   help="Media items per request before the range ratio is applied.")
    g.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                   help="Items per request drawn uniformly from base*(1-r) .. base*(1+r); 0 <= r <= 1.")
    g.add_argument("--random-mm-limit-mm-per-prompt", type=str, default=DEFAULT_LIMITS,
                   help="Most items per modality in one request (JSON); keep it within the server's "
                   "--limit-mm-per-prompt.")
    g.add_argument("--random-mm-bucket-config", type=str, default=DEFAULT_BUCKETS,
                   help="{(height, width, frames): probability}; frames 1 = image, more = video.")


def parse_buckets(text: str) -> list[tuple[tuple[int, int, int], float]]:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--random-mm-bucket-config must be a dict like {DEFAULT_BUCKETS}; got {text!r}: {e}") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"--random-mm-bucket-config must be a non-empty dict like {DEFAULT_BUCKETS}; got {text!r}")
    out = []
    for key, p in value.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(v, int) and v > 0 for v in key)):
            raise ValueError(f"--random-mm-bucket-config key {key!r} must be (height, width, frames) of positive ints")
        if not isinstance(p, (int, float)) or p < 0:
            raise ValueError(f"--random-mm-bucket-config probability for {key} must be >= 0, got {p!r}")
        out.append((key, float(p)))
    if sum(p for _, p in out) <= 0:
        raise ValueError("--random-mm-bucket-config probabilities must not all be 0")
    return out


def parse_limits(text: str) -> dict[str, int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--random-mm-limit-mm-per-prompt must be JSON like {DEFAULT_LIMITS}: {e}") from None
    if not isinstance(value, dict) or any(k not in ("image", "video") or not isinstance(v, int) or v < 0
                                          for k, v in value.items()):
        raise ValueError(f"--random-mm-limit-mm-per-prompt must map image/video to counts >= 0; got {text!r}")
    return {"image": value.get("image", 0), "video": value.get("video", 0)}


def _png(rng: np.random.Generator, h: int, w: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _mp4(rng: np.random.Generator, h: int, w: int, frames: int) -> str:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=1)
        s.width, s.height, s.pix_fmt = w - w % 2, h - h % 2, "yuv420p"
        for _ in range(frames):
            img = rng.integers(0, 256, (s.height, s.width, 3), dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def media_parts(rng: np.random.Generator, n_items: int, buckets, limits: dict[str, int]) -> list[dict[str, Any]]:
    """Up to n_items content parts drawn from the buckets, never more of a modality than its limit."""
    parts: list[dict[str, Any]] = []
    used = {"image": 0, "video": 0}
    for _ in range(n_items):
        allowed = [(k, p) for k, p in buckets if used["image" if k[2] == 1 else "video"] < limits[
            "image" if k[2] == 1 else "video"] and p > 0]
        if not allowed:
            break
        probs = np.array([p for _, p in allowed])
        (h, w, t), _ = allowed[int(rng.choice(len(allowed), p=probs / probs.sum()))]
        if t == 1:
            used["image"] += 1
            parts.append({"type": "image_url", "image_url": {"url": _png(rng, h, w)}})
        else:
            used["video"] += 1
            parts.append({"type": "video_url", "video_url": {"url": _mp4(rng, h, w, t)}})
    return parts


def sample_random_mm_requests(tokenizer: Any, num_requests: int, *, input_len: int, output_len: int,
                              range_ratio: float, base_items: int, items_range_ratio: float,
                              limits: dict[str, int], buckets, seed: int = 0) -> list[SampleRequest]:
    if base_items < 0:
        raise ValueError(f"--random-mm-base-items-per-request must be >= 0, got {base_items}")
    if not 0.0 <= items_range_ratio <= 1.0:
        raise ValueError(f"--random-mm-num-mm-items-range-ratio must be in [0, 1], got {items_range_ratio}")
    requests = sample_random_requests(tokenizer, num_requests, input_len=input_len, output_len=output_len,
                                      range_ratio=range_ratio, seed=seed)
    rng = np.random.default_rng(seed + 1)
    low = int(np.floor(base_items * (1 - items_range_ratio)))
    high = int(np.ceil(base_items * (1 + items_range_ratio)))
    for r in requests:
        r.multi_modal_content = media_parts(rng, int(rng.integers(low, high + 1)), buckets, limits)
    return requests
