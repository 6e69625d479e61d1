"""Media loading and the Qwen3-VL input processor: placeholders expanded per image grid, hashes that
follow the pixels, and every bad input refused with a ValueError naming the problem."""
from __future__ import annotations


import pytest

from tests.vlm_factory import (IMAGE_PAD, MERGE, VIDEO_PAD, data_url, png_bytes, random_image, solid_image,
                                tiny_qwen3_vl_config)
from vllm_neuron.multimodal.media import load_image
from vllm_neuron.multimodal.processor import MultiModalProcessor




@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from tests.vlm_factory import image_processor

    path = str(tmp_path_factory.mktemp("proc"))
    image_processor().save_pretrained(path)
    return MultiModalProcessor(tiny_qwen3_vl_config(), path, limits={"image": 2},
                               allowed_local_media_path=str(tmp_path_factory.mktemp("media")))


def test_placeholders_expand_per_image_grid(processor):
    ids, items = processor.process([5, IMAGE_PAD, 6, IMAGE_PAD], {"image": [random_image(56, 84, 0),
                                                                           random_image(112, 112, 1)]})
    assert [i.grid_thw for i in items] == [(1, 4, 6), (1, 8, 8)]
    n0, n1 = 4 * 6 // MERGE ** 2, 8 * 8 // MERGE ** 2
    assert ids == [5] + [IMAGE_PAD] * n0 + [6] + [IMAGE_PAD] * n1
    assert items[0].runs == [(1, (1, 2, 3))] and items[1].runs == [(2 + n0, (1, 4, 4))]
    assert items[0].mm_hash != items[1].mm_hash


def test_hash_follows_the_pixels_not_the_source(processor):
    img = random_image(56, 56, 3)
    _, a = processor.process([IMAGE_PAD], {"image": img})
    _, b = processor.process([IMAGE_PAD], {"image": data_url(png_bytes(img))})
    _, c = processor.process([IMAGE_PAD], {"image": solid_image(56, 56, (0, 0, 0))})
    assert a[0].mm_hash == b[0].mm_hash != c[0].mm_hash


@pytest.mark.parametrize("ids, data, match", [
    ([5, IMAGE_PAD], {"image": []}, "1 image placeholder.* but 0 image"),
    ([5], {"image": "IMG"}, "0 image placeholder.* but 1 image"),
    ([IMAGE_PAD] * 3, {"image": ["IMG"] * 3}, r"At most 2 image\(s\) .* got 3 \(--limit-mm-per-prompt\)"),
    ([IMAGE_PAD], {"audio": "x"}, "unknown modality 'audio'"),
    ([5], {"video": "data:video/mp4;base64,AAAA"}, "0 video placeholder.* but 1 video"),
    ([IMAGE_PAD], {"image": "data:image/png;base64,bm90IGFuIGltYWdl"}, "cannot decode the data: URL image"),
    ([IMAGE_PAD], {"image": "data:text/plain;base64,aGVsbG8="}, "media type 'text/plain' .* not supported"),
    ([IMAGE_PAD], {"image": "data:image/png;base64,@@@"}, "not valid base64"),
    ([IMAGE_PAD], {"image": "file:///etc/passwd"}, "outside the allowed local media folder"),
    ([IMAGE_PAD], {"image": "ftp://host/x.png"}, "scheme 'ftp' is not supported"),
])
def test_bad_inputs_are_refused(processor, ids, data, match):
    data = {k: ([random_image(56, 56, 0) if x == "IMG" else x for x in v] if isinstance(v, list)
                else (random_image(56, 56, 0) if v == "IMG" else v)) for k, v in data.items()}
    with pytest.raises(ValueError, match=match):
        processor.process(ids, data)


def test_local_files_load_only_under_the_allowed_folder(processor, tmp_path):
    inside = processor.allowed_local_media_path + "/cat.png"
    with open(inside, "wb") as f:
        f.write(png_bytes(random_image(56, 56, 4)))
    assert load_image("file://" + inside, processor.media_access).size == (56, 56)
    with pytest.raises(ValueError, match="not started with --allowed-local-media-path"):
        load_image("file://" + inside)
    with pytest.raises(ValueError, match="outside the allowed"):
        load_image("file://" + processor.allowed_local_media_path + "/../x.png", processor.media_access)


def test_unknown_processor_kwargs_are_refused(processor):
    with pytest.raises(ValueError, match="mm_processor_kwargs has unknown key.*'max_pixel'.*valid keys"):
        processor.process([IMAGE_PAD], {"image": random_image(56, 56, 0)}, {"max_pixel": 10})
    # max_pixels shrinks the image: fewer tokens.
    ids, items = processor.process([IMAGE_PAD], {"image": random_image(112, 112, 0)}, {"max_pixels": 56 * 56})
    assert items[0].grid_thw == (1, 4, 4) and len(ids) == 4


def test_language_model_only_refuses_media(processor):
    text_only = MultiModalProcessor(tiny_qwen3_vl_config(), processor.model_path, language_model_only=True)
    with pytest.raises(ValueError, match="mm_language_model_only"):
        text_only.process([IMAGE_PAD], {"image": random_image(56, 56, 0)})


def test_an_image_larger_than_an_encoder_block_is_refused(processor):
    small = MultiModalProcessor(tiny_qwen3_vl_config(), processor.model_path, max_frame_patches=32)
    with pytest.raises(ValueError, match="an image of 64 patches \\(8x8\\) does not fit encoder_attention_block_size=32"):
        small.process([IMAGE_PAD], {"image": random_image(112, 112, 0)})


class _CharTokenizer:
    """Just enough tokenizer for the timestamps written before each video frame pair: one id per character."""

    def encode(self, text, add_special_tokens=False):
        return [1000 + ord(c) for c in text]


def _video_processor(processor) -> MultiModalProcessor:
    return MultiModalProcessor(tiny_qwen3_vl_config(), processor.model_path, tokenizer=_CharTokenizer())


def _stamps(ids) -> list[str]:
    text = "".join(chr(t - 1000) if t >= 1000 and t < VIDEO_PAD - 8 else "|" for t in ids)
    return [part for part in text.split("|") if part]


def test_video_frames_and_metadata_tuple_is_one_video(processor):
    """Seed 000's offline example passes {"video": (frames, metadata)} (vLLM's VideoAsset form): one video,
    its frames taken as sampled, each pair timed by its frames' places in the source (frames_indices / fps)."""
    import numpy as np

    frames = np.stack([np.asarray(random_image(56, 56, 20 + i)) for i in range(4)])
    meta = {"fps": 10.0, "frames_indices": [0, 10, 20, 30], "total_num_frames": 40, "duration": 4.0,
            "video_backend": "opencv"}
    proc = _video_processor(processor)
    ids, items = proc.process([5, VIDEO_PAD, 6], {"video": (frames, meta)})
    assert len(items) == 1 and items[0].grid_thw == (2, 4, 4) and len(items[0].runs) == 2
    assert _stamps(ids) == ["<0.5 seconds>", "<2.5 seconds>"]  # (0 + 1.0) / 2, (2.0 + 3.0) / 2
    # The same frames as a plain array: the pixels are the same video, timed at transformers' 24 fps default.
    plain_ids, plain = proc.process([5, VIDEO_PAD, 6], {"video": frames})
    assert plain[0].mm_hash == items[0].mm_hash and _stamps(plain_ids) == ["<0.0 seconds>", "<0.1 seconds>"]
    # Several videos: a list of tuples; without frames_indices the frames are 0, 1, 2, ... of the source.
    _, two = proc.process([VIDEO_PAD, VIDEO_PAD], {"video": [(frames, {"fps": 2}), (frames[:2], {"fps": 2})]})
    assert [i.grid_thw for i in two] == [(2, 4, 4), (1, 4, 4)]
    # do_sample_frames: the frames (20) are the whole source, sampled at the requested fps (2): 0, 5, 10, 15.
    sampled_ids, sampled = proc.process([VIDEO_PAD], {"video": (np.concatenate([frames] * 5), {
        "fps": 10.0, "do_sample_frames": True})})
    assert sampled[0].grid_thw == (2, 4, 4) and _stamps(sampled_ids) == ["<0.2 seconds>", "<1.2 seconds>"]


@pytest.mark.parametrize("meta, match", [
    ({"fps": 0}, "video metadata fps must be a positive number"),
    ({"fps": 10, "frames_indices": [0, 1]}, r"frames_indices must give one non-negative index per frame \(4 frames\)"),
    ({"fps": 10, "do_sample_frames": "yes"}, "do_sample_frames must be true or false"),
])
def test_bad_video_metadata_is_refused(processor, meta, match):
    import numpy as np

    frames = np.stack([np.asarray(random_image(56, 56, i)) for i in range(4)])
    with pytest.raises(ValueError, match=match):
        _video_processor(processor).process([VIDEO_PAD], {"video": (frames, meta)})
