"""`vllm-neuron validate-logits`: on tiny random models in fp32 our log-probabilities equal transformers'
fp32 ones at every teacher-forced position (text with Qwen3, an image with Qwen3-VL); bf16 is reported
beside them; the comparison itself flags a wrong top-1 and a large difference."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import make_tiny_model
from tests.vlm_factory import IMAGE, make_tiny_qwen3_vl, png_bytes, random_image
from vllm_neuron import LLM
from vllm_neuron.entrypoints.cli.main import main
from vllm_neuron.entrypoints.cli.validate_logits import compare_position, validate

pytestmark = pytest.mark.engine

ENGINE = dict(dtype="float32", device="cpu", enforce_eager=True, max_model_len=256, max_num_batched_tokens=64,
              block_size=16, num_gpu_blocks_override=64, max_num_seqs=4)


def test_compare_position_flags_differences():
    ref = torch.log_softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), -1)
    same = compare_position({0: float(ref[0]), 1: float(ref[1])}, ref, 2)
    assert same.max_abs_diff == 0 and same.topk_agreement == 1 and same.top1_match
    off = compare_position({2: float(ref[2]) + 0.5, 3: float(ref[3])}, ref, 2)
    assert off.max_abs_diff == pytest.approx(0.5) and off.topk_agreement == 0 and not off.top1_match


def _check(results):
    for r in results:
        assert len(r["fp32"]) == len(r["bf16"]) == 4
        assert all(s.max_abs_diff < 1e-4 and s.topk_agreement == 1 and s.top1_match for s in r["fp32"])


def test_text_model(tmp_path):
    llm = LLM(make_tiny_model(str(tmp_path / "qwen3"), "qwen3"), **ENGINE)
    _check(validate(llm, ["The quick brown fox", "Hello"], 4, 5))


def test_vision_language_model_with_an_image(tmp_path, capsys):
    path = make_tiny_qwen3_vl(str(tmp_path / "vl"))
    llm = LLM(path, **ENGINE)
    _check(validate(llm, [{"prompt": "Look: " + IMAGE + " now", "multi_modal_data": {"image": random_image(56, 84, 0)}}],
                    4, 5))
    img = tmp_path / "img.png"
    img.write_bytes(png_bytes(random_image(56, 56, 1)))
    code = main(["validate-logits", path, "--image", str(img), "--prompt", "Describe.", "--max-tokens", "2",
                 "--fail-above", "1e-4", "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                 "--num-gpu-blocks-override", "64"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "max|d| fp32" in out and "largest difference from transformers fp32" in out
