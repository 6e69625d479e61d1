"""The random-mm benchmark dataset: items per request, sizes and modalities from the bucket config,
per-modality limits, determinism, and the chat body with the media parts before the text."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from vllm_neuron.benchmarks import random_mm
from vllm_neuron.benchmarks.endpoint_request import RequestInput, build_payload


def _size(part) -> tuple[int, int]:
    from PIL import Image

    data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
    return Image.open(io.BytesIO(data)).size


def test_items_follow_buckets_and_limits():
    rng = np.random.default_rng(0)
    buckets = random_mm.parse_buckets("{(32, 48, 1): 1.0, (16, 16, 2): 1.0}")
    parts = random_mm.media_parts(rng, 6, buckets, {"image": 3, "video": 1})
    kinds = [p["type"] for p in parts]
    assert kinds.count("image_url") == 3 and kinds.count("video_url") == 1  # the limits end it at 4 items
    assert all(_size(p) == (48, 32) for p in parts if p["type"] == "image_url")
    assert parts[kinds.index("video_url")]["video_url"]["url"].startswith("data:video/mp4;base64,")
    again = random_mm.media_parts(np.random.default_rng(0), 6, buckets, {"image": 3, "video": 1})
    assert again == parts


@pytest.mark.parametrize("text, match", [("{(1, 2): 1}", "must be \\(height, width, frames\\)"),
                                         ("[1]", "non-empty dict"), ("{(8, 8, 1): 0}", "not all be 0")])
def test_bad_bucket_config(text, match):
    with pytest.raises(ValueError, match=match):
        random_mm.parse_buckets(text)


def test_bad_limits():
    with pytest.raises(ValueError, match="must map image/video"):
        random_mm.parse_limits('{"audio": 1}')


def test_chat_body_puts_media_before_the_text():
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = build_payload(RequestInput("u", "m", "hello", 1, 4, chat=True, multi_modal_content=[part]))
    assert body["messages"][0]["content"] == [part, {"type": "text", "text": "hello"}]
