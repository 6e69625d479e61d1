"""Tiny random-weight Llama checkpoints with the SmolLM2 tokenizer, built locally (no downloads).

    from tests.model_factory import make_tiny_llama, make_tiny_gguf, build_tiny_llama

Every builder is deterministic in its arguments: `build_tiny_llama(**kw)` returns the very model that
`make_tiny_llama(path, **kw)` / `make_tiny_gguf(path, **kw)` wrote, so tests compare against it.

The SmolLM2 tokenizer is converted from the bundled GGUF once per machine and cached under
$VLLM_NEURON_TEST_CACHE (default ~/.cache/vllm_neuron_test): the conversion takes seconds.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import random
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

SMOLLM2_VOCAB_SIZE = 49152
BOS_ID, EOS_ID = 1, 2  # <|im_start|>, <|im_end|>
CACHE_ENV = "VLLM_NEURON_TEST_CACHE"
_GGUF_TOKENIZER_JSON = "gguf_tokenizer_metadata.json"
_GGUF_TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
)


def shared_prefix_prompts(lengths: list[int], shared_len: int, first_shared: int, seed: int) -> list[list[int]]:
    """Random token prompts of the given lengths; prompts from index `first_shared` on take their first
    half from one common prefix of `shared_len` tokens (prefix-cache hits across prompts)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, SMOLLM2_VOCAB_SIZE) for _ in range(shared_len)]
    out = []
    for i, n in enumerate(lengths):
        own = [rng.randrange(3, SMOLLM2_VOCAB_SIZE) for _ in range(n)]
        out.append(shared[:n // 2] + own[n // 2:] if i >= first_shared else own)
    return out


# The tests' engine: fp32 on the CPU, eager, small buckets, a fixed KV pool (no memory probing).
TINY_ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, block_size=16, dtype="float32",
                   device="cpu", num_gpu_blocks_override=160, enforce_eager=True)


def tiny_llm(model_dir: str, **overrides: Any):
    """The tests' engine on `model_dir`: TINY_ENGINE's settings, `overrides` replacing them."""
    from vllm_neuron import LLM

    return LLM(model_dir, **{**TINY_ENGINE, **overrides})


def greedy_reference(hf, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy tokens of `max_new` new tokens (EOS ignored) after each prompt, one at a time."""
    return hf_greedy_reference(hf, prompts, max_new, logits=False)[0]


def hf_greedy_reference(hf, prompts: list[list[int]], max_new: int,
                        logits: bool = True) -> tuple[list[list[int]], list[torch.Tensor] | None]:
    """transformers' greedy generate of `max_new` tokens (EOS ignored), one prompt at a time (no padding):
    the tokens, and with `logits` each step's log-softmax [max_new, vocab] (fp32)."""
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                              output_logits=logits, return_dict_in_generate=True, pad_token_id=EOS_ID)
            tokens.append(out.sequences[0, len(p):].tolist())
            if logits:
                logprobs.append(torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1))
    return tokens, (logprobs if logits else None)


def _cache_root() -> str:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "vllm_neuron_test")
    os.makedirs(root, exist_ok=True)
    return root


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer_dir() -> str:
    """A directory with the bundled SmolLM2 tokenizer saved by save_pretrained (+ its GGUF metadata)."""
    import transformers

    from vllm_neuron.model.loader import bundled_model_path, load_tokenizer
    from vllm_neuron.model.loader.gguf_loader import open_gguf

    gguf_path = bundled_model_path()
    key = f"smollm2_tokenizer-{os.stat(gguf_path).st_size}-tf{transformers.__version__}"
    root = _cache_root()
    final = os.path.join(root, key)
    if os.path.isfile(os.path.join(final, _GGUF_TOKENIZER_JSON)):
        return final
    tmp = tempfile.mkdtemp(dir=root, prefix=key + ".tmp-")
    try:
        load_tokenizer(gguf_path).save_pretrained(tmp)
        reader = open_gguf(gguf_path)
        meta = {k: reader.fields[k].contents() for k in _GGUF_TOKENIZER_KEYS if k in reader.fields}
        # Written last: its presence marks a complete directory.
        with open(os.path.join(tmp, _GGUF_TOKENIZER_JSON), "w", encoding="utf-8") as f:
            json.dump(meta, f)
        # Atomic publish; when a concurrent test process won the race, keep its copy.
        os.rename(tmp, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, _GGUF_TOKENIZER_JSON)):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def tiny_llama_config(
    *,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    **extra: Any,
):
    """A LlamaConfig with the SmolLM2 vocabulary and special tokens. `rope_scaling` is a
    transformers rope dict without theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...}."""
    from transformers import LlamaConfig

    rope: dict[str, Any] = {"rope_type": "default"}
    if rope_scaling:
        rope = dict(rope_scaling)
        rope.setdefault("rope_type", rope.pop("type", "default"))
    rope["rope_theta"] = float(rope_theta)
    extra.setdefault("vocab_size", SMOLLM2_VOCAB_SIZE)
    extra.setdefault("bos_token_id", BOS_ID)
    extra.setdefault("eos_token_id", EOS_ID)
    extra.setdefault("pad_token_id", EOS_ID)
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope,
        **extra,
    )


# Tiny configs per architecture (transformers' own classes): GQA, a few layers; the MoE ones 8 experts,
# top-2; gpt-oss a sliding window (24) shorter than the test prompts and its default YaRN rope.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "gpt_oss": dict(head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=24, swiglu_limit=1.5, attention_bias=True),
    "mistral": dict(head_dim=16, sliding_window=24),  # v0.1's window over every layer, shrunk
    # A local (window 24, rope theta 1e4) and a global layer (1e6); scalar and softcap away from the defaults.
    "gemma3": dict(head_dim=16, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                   query_pre_attn_scalar=24, final_logit_softcapping=10.0, tie_word_embeddings=True),
    # Phi-4-mini's shape: partial rotary (12 of 16 dims) and LongRoPE; original_max_position_embeddings is
    # what the tests' max_model_len (256) reaches, so the short factors serve (phi3_long_rope: the long ones).
    "phi3": dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                                      short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                      long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0]),
                 original_max_position_embeddings=256),
    # V2-Lite's shape, shrunk: no q LoRA, latent 32 + rope 8 (the cache's 40 per token), 4 routed experts (top 2)
    # and a shared one; layer 0 dense; YaRN with mscale_all_dim as V2-Lite sets it.
    "deepseek_v2": dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=256, beta_fast=32, beta_slow=1,
                                             mscale=0.707, mscale_all_dim=0.707)),
    # Granite 3's kind of multipliers (attention scale 1/head_dim instead of 1/sqrt(head_dim)).
    "granite": dict(embedding_multiplier=12.0, attention_multiplier=1 / 16, residual_multiplier=0.22,
                    logits_scaling=8.0),
}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
                   "gpt_oss": "GptOssConfig", "mistral": "MistralConfig", "gemma3": "Gemma3TextConfig",
                   "phi3": "Phi3Config", "granite": "GraniteConfig", "deepseek_v2": "DeepseekV2Config"}
_MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "gpt_oss": "GptOssForCausalLM", "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}


def tiny_config(arch: str = "llama", **kw: Any):
    """A tiny transformers config of `arch` (a model_type: llama, qwen3, qwen3_moe, gpt_oss) with the
    SmolLM2 vocabulary and special tokens."""
    import transformers

    if arch == "llama":
        return tiny_llama_config(**kw)
    args: dict[str, Any] = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
                                vocab_size=SMOLLM2_VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                pad_token_id=EOS_ID)
    args.update(copy.deepcopy(ARCH_DEFAULTS[arch]))  # transformers edits nested rope dicts in place
    args.update(kw)
    rope_theta = args.pop("rope_theta", None)
    cfg = getattr(transformers, _CONFIG_CLASSES[arch])(architectures=[_MODEL_CLASSES[arch]], **args)
    if rope_theta is not None:
        cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": float(rope_theta)}
    return cfg


def build_tiny_model(arch: str = "llama", *, dtype: torch.dtype = torch.float32, seed: int = 0,
                     **config_kwargs: Any):
    """A transformers model of `arch` with seeded random weights, in eval mode.

    Weights are drawn at unit scale (std 1/sqrt(fan_in), embeddings std 1) rather than transformers'
    std 0.02 so activations and logits are O(1) and greedy choices are decisive; norm weights are
    perturbed away from 1 so that a swapped or missing norm is detectable.
    """
    import transformers
    from transformers import GenerationConfig

    config = tiny_config(arch, **config_kwargs)
    model = getattr(transformers, _MODEL_CLASSES[arch])(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("self_attn.sinks"):
                p.copy_(2.0 + 2.0 * noise)  # large enough that a missing sink changes tokens
            elif p.ndim == 1:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif p.ndim == 3:  # stacked experts [E, a, b]: fan_in is one of a, b
                p.copy_(noise / math.sqrt(math.sqrt(p.shape[1] * p.shape[2])))
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    return model.to(dtype).eval()


def build_tiny_llama(*, dtype: torch.dtype = torch.float32, seed: int = 0, **config_kwargs: Any):
    """build_tiny_model("llama", ...)."""
    return build_tiny_model("llama", dtype=dtype, seed=seed, **config_kwargs)


def make_tiny_llama(path: str, **kw: Any) -> str:
    """make_tiny_model(path, "llama", ...)."""
    return make_tiny_model(path, "llama", **kw)


def make_tiny_model(
    path: str,
    arch: str = "llama",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shard: bool = False,
    generation_config: dict | None = None,
    model=None,
    **config_kwargs: Any,
) -> str:
    """Writes a Hugging Face directory (config.json, safetensors, generation_config.json, SmolLM2
    tokenizer files) of build_tiny_model(arch, dtype=dtype, seed=seed, **config_kwargs) (or of `model`).
    `shard` splits the weights over several files with an index; `generation_config` adds fields."""
    model = model if model is not None else build_tiny_model(arch, dtype=dtype, seed=seed, **config_kwargs)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, max_shard_size="4MB" if shard else "50GB")
    if generation_config:
        # Merged into the JSON directly: GenerationConfig refuses e.g. temperature without do_sample.
        gen_path = os.path.join(path, "generation_config.json")
        with open(gen_path, encoding="utf-8") as f:
            gen = json.load(f)
        gen.update(generation_config)
        with open(gen_path, "w", encoding="utf-8") as f:
            json.dump(gen, f, indent=2)
    tok_dir = smollm2_tokenizer_dir()
    for name in os.listdir(tok_dir):
        if name != _GGUF_TOKENIZER_JSON:
            shutil.copy(os.path.join(tok_dir, name), os.path.join(path, name))
    return path


# HF name pieces -> llama.cpp names; written independently of the loader's map so tests check it.
_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    _, _, idx, rest = hf_name.split(".", 3)  # model.layers.N.rest
    return f"blk.{idx}.{_HF_TO_GGUF_LAYER[rest]}"


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf: interleave the two rotary halves of each head.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    theta, factor = rope["rope_theta"], rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# Byte offsets of the float16 scale fields (d, dmin) in one block of the types the gguf package can only
# dequantize (llama.cpp's ggml-common.h block layouts); every other byte of a block is quant bits or packed
# 6-bit scales, for which any value is valid.
_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "IQ4_XS": (0,), "IQ4_NL": (0,)}


def random_gguf_blocks(shape: tuple[int, ...], quant: str, seed: int = 0) -> np.ndarray:
    """Valid raw blocks of GGUF type `quant` for a tensor of `shape` (uint8, [..., row bytes]): random quant
    bits and packed scales, the float16 super-block scales drawn small and finite so that `gguf.quants.
    dequantize` (the reference) gives O(0.1-1) weights. For the types `gguf.quants.quantize` cannot write."""
    import gguf

    block, nbytes = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]]
    if shape[-1] % block:
        raise ValueError(f"random_gguf_blocks: rows of {shape[-1]} are not whole {quant} blocks of {block}")
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[quant]:
        scale = (rng.uniform(0.002, 0.02, size=raw.shape[:-1]) * rng.choice([-1, 1], size=raw.shape[:-1]))
        raw[..., off:off + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def _add_weight(writer, name: str, w: np.ndarray, dtype: torch.dtype, quant: str | None, seed: int = 0) -> None:
    import gguf

    if w.ndim == 1 or (dtype == torch.float32 and quant is None):
        writer.add_tensor(name, w.astype(np.float32))  # llama.cpp keeps norms in F32
    elif quant in _F16_FIELDS:
        raw = random_gguf_blocks(w.shape, quant, seed=seed + zlib.crc32(name.encode()))
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[quant])
    elif quant is not None:
        qtype = gguf.GGMLQuantizationType[quant]
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)
    elif dtype == torch.float16:
        writer.add_tensor(name, w.astype(np.float16))
    elif dtype == torch.bfloat16:
        raw = torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        raise ValueError(f"make_tiny_gguf: dtype must be float32, float16 or bfloat16, got {dtype}")


def gguf_writer_with_sizes(file: str, arch: str, cfg, split_max_tensors: int = 0):
    """A GGUFWriter for `file` holding the sizes every architecture writes (layers, context, widths, heads);
    with `split_max_tensors` it writes llama.cpp's split parts `<stem>-0000i-of-0000N.gguf` instead."""
    import gguf

    w = gguf.GGUFWriter(file, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    return w


def write_gguf(w) -> None:
    """Header, metadata and tensors to the writer's file, then closed."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_smollm2_tokenizer(w, chat_template: str | None = None) -> None:
    """The SmolLM2 tokenizer and chat template (or `chat_template`) as GGUF metadata (llama.cpp's keys)."""
    with open(os.path.join(smollm2_tokenizer_dir(), _GGUF_TOKENIZER_JSON), encoding="utf-8") as f:
        tok = json.load(f)
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_unk_token_id(tok["tokenizer.ggml.unknown_token_id"])
    w.add_add_bos_token(tok["tokenizer.ggml.add_bos_token"])
    w.add_add_space_prefix(tok["tokenizer.ggml.add_space_prefix"])
    w.add_chat_template(chat_template or tok["tokenizer.chat_template"])


def make_tiny_gguf(
    path: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    quant: str | None = None,
    tokenizer: bool = True,
    arch: str = "llama",
    split_max_tensors: int = 0,
    chat_template: str | None = None,
    quant_by_name: dict[str, str] | None = None,
    **config_kwargs: Any,
) -> str:
    """Writes build_tiny_llama(seed=seed, **config_kwargs) as a llama.cpp-style GGUF file (Q/K
    permuted, SmolLM2 tokenizer metadata, llama3 rope scaling as a rope_freqs tensor) and returns
    its path. `path` is the .gguf file, or a directory to hold tiny-llama.gguf. Matrices are stored
    as `dtype` (float32/float16/bfloat16) or, with `quant` (e.g. "Q8_0"), quantized; for the types the gguf
    package cannot quantize (K-quants, IQ4_XS, IQ4_NL) the matrices are random valid blocks of the type
    (random_gguf_blocks), so the file is no longer the source model: its reference is gguf's dequantize.
    `tokenizer=False` leaves out the tokenizer metadata: GGUFReader then opens the file in
    milliseconds instead of the seconds it spends parsing 49k tokens and merges. `arch` "qwen3" writes
    build_tiny_model("qwen3", ...) as llama.cpp's `qwen3` architecture (no Q/K permutation, q/k norms).
    `split_max_tensors` > 0 splits the file into parts of at most that many tensors, named and keyed as
    llama.cpp's gguf-split writes them; the first part's path is returned. `chat_template` replaces
    SmolLM2's in the tokenizer metadata. `quant_by_name` ({"ffn_down": "Q8_0", ...}: a part of the GGUF tensor
    name -> its type) overrides `quant` for the matrices it names, as llama.cpp's mixed files (Q4_K_M) do."""
    import gguf

    file = path if path.endswith(".gguf") else os.path.join(path, "tiny-llama.gguf")
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    model = build_tiny_model(arch, dtype=torch.float32, seed=seed, **config_kwargs)
    cfg = model.config
    rope = dict(cfg.rope_parameters)
    head_dim = cfg.head_dim

    w = gguf_writer_with_sizes(file, arch, cfg, split_max_tensors)
    w.add_name("tiny-llama")
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if quant is None and dtype == torch.float32
                    else gguf.LlamaFileType.GUESSED)
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(rope, head_dim))
    elif kind != "default":
        raise ValueError(f"make_tiny_gguf: rope_type {kind!r} not supported (default, linear, yarn, llama3)")

    w.add_bos_token_id(cfg.bos_token_id)  # special ids are cheap: always written
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    if tokenizer:
        add_smollm2_tokenizer(w, chat_template)

    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().numpy()
        if arch != "llama":
            pass  # llama.cpp permutes Q/K for the llama architecture only
        elif name.endswith("q_proj.weight"):
            arr = _llamacpp_permute(arr, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = _llamacpp_permute(arr, cfg.num_key_value_heads)
        gguf_name = _gguf_name(name)
        own = next((q for part, q in (quant_by_name or {}).items() if part in gguf_name), quant)
        _add_weight(w, gguf_name, np.ascontiguousarray(arr), dtype, own, seed)

    write_gguf(w)
    return str(w.format_shard_names(Path(file))[0])


def build_tiny_gpt_oss_mxfp4(**config_kwargs: Any):
    """(transformers gpt-oss whose expert weights are MXFP4-representable, {param name: (blocks, scales)}):
    the experts are rounded to MXFP4, so the model holds exactly what the packed tensors dequantize to."""
    from vllm_neuron.model.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    hf = build_tiny_model("gpt_oss", **config_kwargs)
    packed = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantize_mxfp4(p.transpose(1, 2))  # checkpoints pack [E, out, in]
                p.copy_(dequantize_mxfp4(blocks, scales, p.dtype).transpose(1, 2))
                packed[name] = (blocks, scales)
    return hf, packed


def make_tiny_gpt_oss_mxfp4(path: str, **config_kwargs: Any) -> str:
    """A gpt-oss HF directory as gpt-oss ships: experts as `<name>_blocks` + `<name>_scales` (uint8),
    `quantization_config` {"quant_method": "mxfp4"}; its twin is build_tiny_gpt_oss_mxfp4(**config_kwargs)[0]."""
    from safetensors.torch import load_file, save_file

    hf, packed = build_tiny_gpt_oss_mxfp4(**config_kwargs)
    make_tiny_model(path, "gpt_oss", model=hf)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    for name, (blocks, scales) in packed.items():
        del state[name]
        state[name + "_blocks"], state[name + "_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(state, file, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                     "model.layers.*.mlp.router",
                                                                                     "model.embed_tokens", "lm_head"]}
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return path


def make_tiny_eagle3(path: str, *, target_hidden: int = 64, hidden_size: int = 64, vocab_size: int = SMOLLM2_VOCAB_SIZE,
                     draft_vocab_size: int = 4096, aux_layer_ids: list[int] | None = None, seed: int = 0,
                     own_embedding: bool = False, scale: float = 0.2, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int = 128) -> str:
    """A random EAGLE3 draft in vLLM's `LlamaForCausalLMEagle3` layout (midlayer.*, fc, norm, lm_head,
    d2t / t2d over a draft vocabulary of the target ids 0, 12, 24, ... ), written as config.json +
    model.safetensors. Returns `path`."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, inter = num_heads, num_kv_heads, intermediate_size
    d = hidden_size // heads

    def w(*shape):
        return (torch.randn(*shape, generator=g) * scale).contiguous()
    ids = torch.arange(draft_vocab_size) * (vocab_size // draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    state = {
        "fc.weight": w(hidden_size, 3 * target_hidden), "norm.weight": 1 + w(hidden_size),
        "lm_head.weight": w(draft_vocab_size, hidden_size), "d2t": ids - torch.arange(draft_vocab_size), "t2d": t2d,
        "midlayer.input_layernorm.weight": 1 + w(hidden_size), "midlayer.hidden_norm.weight": 1 + w(hidden_size),
        "midlayer.post_attention_layernorm.weight": 1 + w(hidden_size),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * hidden_size),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * d, 2 * hidden_size),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * d, 2 * hidden_size),
        "midlayer.self_attn.o_proj.weight": w(hidden_size, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden_size), "midlayer.mlp.up_proj.weight": w(inter, hidden_size),
        "midlayer.mlp.down_proj.weight": w(hidden_size, inter),
    }
    if own_embedding:
        state["embed_tokens.weight"] = w(vocab_size, hidden_size)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden_size,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": vocab_size,
           "draft_vocab_size": draft_vocab_size, "target_hidden_size": target_hidden,
           "max_position_embeddings": 2048, "torch_dtype": "float32"}
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return path


def make_tiny_dflash(path: str, *, hidden_size: int = 64, vocab_size: int = SMOLLM2_VOCAB_SIZE,
                     target_layer_ids: list[int] | None = None, num_layers: int = 2, block_size: int | None = 8,
                     mask_token_id: int = 7, seed: int = 0, scale: float = 0.2, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int = 128, speculators: bool = False) -> str:
    """A random DFlash draft in z-lab's / vLLM's `DFlashDraftModel` layout (layers.* with q/k norms, fc over the
    taps, hidden_norm, norm; the target's embedding and lm_head), or in speculators' layout, written as
    config.json + model.safetensors. target_layer_ids: the tapped layers' outputs (default [0, 1])."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    ids = target_layer_ids if target_layer_ids is not None else [0, 1]
    h, d, inter = hidden_size, hidden_size // num_heads, intermediate_size

    def w(*shape):
        return (torch.randn(*shape, generator=g) * scale).contiguous()
    state = {"fc.weight": w(h, len(ids) * h), "hidden_norm.weight": 1 + w(h), "norm.weight": 1 + w(h)}
    for i in range(num_layers):
        p = f"layers.{i}."
        state.update({
            p + "input_layernorm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h),
            p + "self_attn.q_proj.weight": w(num_heads * d, h), p + "self_attn.k_proj.weight": w(num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": w(num_kv_heads * d, h), p + "self_attn.o_proj.weight": w(h, num_heads * d),
            p + "self_attn.q_norm.weight": 1 + w(d), p + "self_attn.k_norm.weight": 1 + w(d),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter)})
    layer = {"model_type": "qwen3", "hidden_size": h, "intermediate_size": inter, "num_attention_heads": num_heads,
             "num_key_value_heads": num_kv_heads, "head_dim": d, "num_hidden_layers": num_layers, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "vocab_size": vocab_size, "max_position_embeddings": 2048}
    if speculators:
        cfg = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
               "transformer_layer_config": layer, "draft_vocab_size": vocab_size, "block_size": block_size,
               "aux_hidden_state_layer_ids": [i + 1 for i in ids], "mask_token_id": mask_token_id}
    else:
        cfg = {"architectures": ["DFlashDraftModel"], **layer, "block_size": block_size,
               "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids}}
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return path


def generate_token_ids(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """The first completion's token ids of each token-id prompt."""
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


LORA_ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(path: str, base, *, r: int = 8, lora_alpha: float = 16.0, seed: int = 1,
                      targets: tuple[str, ...] = LORA_ALL_TARGETS, use_rslora: bool = False,
                      scale: float = 1.0) -> str:
    """Writes a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) for the transformers
    model `base` (not modified): seeded random A and B (PEFT's B starts at zero, which would change nothing),
    at unit scale like build_tiny_model's weights times `scale`, so the adapter changes greedy tokens."""
    import copy

    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                     use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(p.shape[1]))
    peft_model.save_pretrained(path)
    return path


def merged_lora_model(base, adapter_dir: str, merge: bool = True):
    """transformers' `base` (a copy) with the adapter: merged into the weights (merge_and_unload), or kept
    beside them as PEFT computes it (merge=False)."""
    import copy

    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir)
    return (model.merge_and_unload() if merge else model).eval()


def cached_greedy_reference(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy tokens of a transformers (or PEFT) causal LM, one prompt at a time through its KV cache, logits of
    the last position only: the same tokens as `greedy_reference` at a fraction of generate()'s overhead."""
    out = []
    with torch.no_grad():
        for p in prompts:
            o = model(input_ids=torch.tensor([p]), use_cache=True, logits_to_keep=1)
            new = [int(o.logits[0, -1].argmax())]
            for _ in range(max_new - 1):
                o = model(input_ids=torch.tensor([[new[-1]]]), cache=o.cache, use_cache=True, logits_to_keep=1)
                new.append(int(o.logits[0, -1].argmax()))
            out.append(new)
    return out
