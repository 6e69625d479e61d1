"""Tensor capture and replacement on a tiny random Llama against transformers (fp32): captured module outputs
equal transformers' (eager on MRv1, compiled on MRv2, every position of prefill and decode); replacing layer
0's output with transformers' layer-0 output of another prompt makes layer 1 and the next token that prompt's;
bad options fail at start naming the problem; validate-logits --per-module finds a deliberately broken MLP and
compares a vision-language model's vision tower too."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_factory import build_tiny_llama, greedy_reference, tiny_llm
from vllm_neuron import SamplingParams
from vllm_neuron.entrypoints.cli.main import main
from vllm_neuron.entrypoints.cli.validate_modules import reference_outputs

pytestmark = pytest.mark.engine

A = [1, 57, 300, 9, 4021, 77, 12, 905, 33, 6, 41]
B = [2, 18, 640, 91, 5, 3020, 44, 7, 815, 60, 29]  # the same length as A
MODULES = ["model.layers.1", "model.layers.0.mlp"]
BUCKETS = {"num_batched_tokens_buckets": [32], "num_seqs_buckets": [2]}


@pytest.fixture(scope="module")
def hf():
    return build_tiny_llama(max_position_embeddings=512).eval()


def _captures(folder: str, req: str) -> dict[str, torch.Tensor]:
    """A request's captures over its steps, joined along the positions."""
    entries = [json.loads(line) for line in open(os.path.join(folder, "manifest.jsonl"))]
    entries = sorted((e for e in entries if e["request"] == req), key=lambda e: e["step"])
    parts = [load_file(os.path.join(folder, e["file"])) for e in entries]
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}


def _capture_run(path, out_dir, **engine):
    llm = tiny_llm(path, max_num_seqs=2, additional_config={"neuron_config": {**BUCKETS, "tensor_capture": {
        "modules": MODULES, "capture_inputs": True, "output_dir": str(out_dir)}}}, **engine)
    try:
        outs = llm.generate([{"prompt_token_ids": A}, {"prompt_token_ids": B}],
                            SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], {r: _captures(str(out_dir), r) for r in ("0", "1")}


@pytest.fixture(scope="module")
def eager_run(tiny_llama_512_dir, tmp_path_factory):
    return _capture_run(tiny_llama_512_dir, tmp_path_factory.mktemp("eager"))


def test_eager_capture_equals_transformers_at_every_position(eager_run, hf):
    tokens, caps = eager_run
    assert tokens == greedy_reference(hf, [A, B], 3)
    for rid, prompt, toks in (("0", A, tokens[0]), ("1", B, tokens[1])):
        full = prompt + toks[:-1]  # the positions the engine computed: the prompt, then 2 decode steps
        ref = reference_outputs(hf, full, MODULES + ["model.layers.0"])
        got = caps[rid]
        assert got["model.layers.1"].shape == (len(full), 64)
        torch.testing.assert_close(got["model.layers.1"], ref["model.layers.1"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["model.layers.0.mlp"], ref["model.layers.0.mlp"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["model.layers.1.input"], ref["model.layers.0"], atol=1e-5, rtol=1e-5)


def test_compiled_capture_equals_eager(eager_run, tiny_llama_512_dir, tmp_path):
    tokens, caps = _capture_run(tiny_llama_512_dir, tmp_path / "compiled", enforce_eager=False)
    assert tokens == eager_run[0]
    for rid in ("0", "1"):
        for name, t in eager_run[1][rid].items():
            torch.testing.assert_close(caps[rid][name], t, atol=1e-5, rtol=1e-5)
    files = os.listdir(tmp_path / "compiled" / "0")
    assert sorted(files) == ["step_0000.safetensors", "step_0001.safetensors", "step_0002.safetensors"]


def test_replacing_layer_0_with_another_prompts_output_makes_layer_1_that_prompts(tiny_llama_512_dir, hf, tmp_path):
    ref_b = reference_outputs(hf, B, ["model.layers.0", "model.layers.1"])
    ref_a = reference_outputs(hf, A, ["model.layers.1"])
    save_file({"model.layers.0": ref_b["model.layers.0"].contiguous()}, str(tmp_path / "r.safetensors"))
    llm = tiny_llm(tiny_llama_512_dir, max_num_seqs=2, additional_config={"neuron_config": {**BUCKETS, "tensor_capture": {
        "modules": ["model.layers.1"], "output_dir": str(tmp_path / "cap")},
        "tensor_replacement": {"file": str(tmp_path / "r.safetensors")}}})
    try:
        assert not llm.llm_engine.core.config.enable_prefix_caching  # replaced K/V must never be shared
        out = llm.generate({"prompt_token_ids": A}, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    got = _captures(str(tmp_path / "cap"), "0")["model.layers.1"]
    torch.testing.assert_close(got, ref_b["model.layers.1"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, ref_a["model.layers.1"], atol=1e-3)
    assert out[0].outputs[0].token_ids == greedy_reference(hf, [B], 1)[0]


def test_bad_options_fail_at_start_naming_the_problem(tiny_llama_512_dir, tmp_path):
    with pytest.raises(ValueError, match=r"'model.layer.1' matches no module of this model; modules include: "
                                         r"model, model.embed_tokens"):
        tiny_llm(tiny_llama_512_dir, additional_config={"neuron_config": {"tensor_capture": {
            "modules": ["model.layer.1"]}}})
    save_file({"model.layers.0": torch.zeros(4, 63)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.0' in .* is \[4, 63\]; the module's output is "
                                         r"\[positions, 64\] \(float32\)"):
        tiny_llm(tiny_llama_512_dir, additional_config={"neuron_config": {"tensor_replacement": {
            "file": str(tmp_path / "bad.safetensors")}}})


def test_per_module_validation_finds_a_broken_mlp(tiny_llama_512_dir, monkeypatch, capsys):
    from vllm_neuron.model.llama.model import LlamaDecoderLayer, LlamaMLP

    args = ["validate-logits", tiny_llama_512_dir, "--per-module", "--prompt", "hello world", "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--fail-above", "1"]
    assert main(args) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "no module differs beyond 0.0001" in out and "model.layers.1.mlp" in out
    class Broken(LlamaMLP):  # the last layer's MLP is off by 1%: the drift starts there, not before
        def forward(self, x):
            return super().forward(x) * 1.01

    def make_mlp(self, cfg, layer_idx):
        return (Broken if layer_idx == 1 else LlamaMLP)(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    monkeypatch.setattr(LlamaDecoderLayer, "make_mlp", make_mlp)
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "first divergence: model.layers.1.mlp" in out, out


def test_per_module_validation_of_a_vision_language_model_with_an_image(tmp_path, capsys):
    from tests.vlm_factory import make_tiny_qwen3_vl, png_bytes, random_image

    path = make_tiny_qwen3_vl(str(tmp_path / "vl"))
    (tmp_path / "img.png").write_bytes(png_bytes(random_image(56, 84, 1)))
    assert main(["validate-logits", path, "--per-module", "--image", str(tmp_path / "img.png"), "--prompt", "Describe.",
                 "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
                 "--fail-above", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("model.")}
    # The vision tower (captured in the encoder graph, rows back in the image's order) and the text tower.
    for name in ("model.visual.patch_embed", "model.visual.blocks.2", "model.visual.merger",
                 "model.language_model.layers.2.mlp"):
        assert float(rows[name][0]) < 1e-4, out
    assert rows["model.visual.merger"][2] == "-" and float(rows["model.language_model.layers.2"][2]) < 1e-4
    assert "no module differs beyond 0.0001" in out
