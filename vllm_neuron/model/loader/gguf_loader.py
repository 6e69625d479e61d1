"""GGUF files (llama.cpp format): metadata -> transformers config, tensors -> HF names and layouts.

The `llama` (SmolLM2, Llama 2/3.x, Mistral-style files), `qwen3`, `qwen3moe`, `gemma3`, `phi3`, `granite`,
`deepseek2` and `gpt-oss` architectures are mapped (what each adds: gguf_arches.py). Quantized tensors are
dequantized to float32 with `gguf.quants`; Q/K projections of the Llama-lineage files (llama, granite) are
un-permuted back from llama.cpp's rotary layout and Gemma's norm shift is taken back out, so that every tensor
equals what transformers would hold; gpt-oss's MXFP4 experts are repacked (not dequantized) into the `_blocks` /
`_scales` its checkpoints hold, for the model to keep packed or dequantize. A GGUF split into `-0000i-of-0000N`
parts reads as one file (gguf_split.py).
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Any, Iterator

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import PretrainedConfig

from vllm_neuron.model.loader.gguf_arches import GGUF_ARCHES
from vllm_neuron.model.loader.gguf_split import SplitGGUF, open_split

SUPPORTED_ARCHITECTURES = tuple(GGUF_ARCHES)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Consumed by the config (llama3 rope scaling), not a model parameter.
_CONFIG_ONLY_TENSORS = {"rope_freqs.weight"}
# blk.N.<suffix> -> model.layers.N.<hf suffix>, and which head count un-permutes it (None: as stored)
_LAYER_TENSORS = {
    "attn_norm.weight": ("input_layernorm.weight", None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None),
    "attn_q.weight": ("self_attn.q_proj.weight", "q"),
    "attn_q.bias": ("self_attn.q_proj.bias", "q"),
    "attn_k.weight": ("self_attn.k_proj.weight", "kv"),
    "attn_k.bias": ("self_attn.k_proj.bias", "kv"),
    "attn_v.weight": ("self_attn.v_proj.weight", None),
    "attn_v.bias": ("self_attn.v_proj.bias", None),
    "attn_output.weight": ("self_attn.o_proj.weight", None),
    "attn_output.bias": ("self_attn.o_proj.bias", None),
    "ffn_gate.weight": ("mlp.gate_proj.weight", None),
    "ffn_up.weight": ("mlp.up_proj.weight", None),
    "ffn_down.weight": ("mlp.down_proj.weight", None),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", None),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", None),
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@functools.lru_cache(maxsize=8)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    return GGUFReader(path)


def _open_one(path: str) -> GGUFReader:
    """A GGUFReader for `path`, shared per file version: parsing a 49k-token vocabulary takes seconds."""
    try:
        st = os.stat(path)
        return _cached_reader(os.path.abspath(path), st.st_mtime_ns, st.st_size)
    except (ValueError, OSError) as e:
        raise ValueError(f"Cannot read GGUF file {path}: {e}") from e


def open_gguf(path: str) -> GGUFReader | SplitGGUF:
    """The file's reader: its metadata (`fields`) and tensors; for the first part of a split GGUF, the
    first part's metadata and every part's tensors (gguf_split.py)."""
    return open_split(path, _open_one(path), _open_one)


def _meta(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _require(reader: GGUFReader, key: str, path: str) -> Any:
    value = _meta(reader, key)
    if value is None:
        raise ValueError(f"GGUF file {path} lacks the metadata key '{key}'")
    return value


def _architecture(reader: GGUFReader, path: str) -> str:
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path} has architecture {arch!r}; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Use a Hugging Face directory for other models."
        )
    return arch


def _tensor_names(reader: GGUFReader) -> set[str]:
    return {t.name for t in reader.tensors}


def _llama3_from_rope_freqs(
    factors: np.ndarray, theta: float, head_dim: int, orig_ctx: int | None, path: str
) -> dict[str, Any]:
    """Recover Llama 3.1 rope scaling from llama.cpp's per-frequency `rope_freqs` tensor.

    The factors fix only two wavelength thresholds, A = original_ctx / low_freq_factor (longer
    waves are divided by `factor`) and B = original_ctx / high_freq_factor (shorter waves are
    kept), with a smooth blend between. original_ctx is taken from the metadata (else from A) and
    the two freq factors are solved for; the result is checked by recomputing the factors.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape[0] != inv_freq.shape[0]:
        raise ValueError(
            f"GGUF file {path}: rope_freqs has {factors.shape[0]} entries, expected {inv_freq.shape[0]}"
        )
    factor = float(factors.max())
    if factor <= 1 + 1e-6:
        return {"rope_type": "default", "rope_theta": theta}
    wavelen = 2 * math.pi / inv_freq
    kept = factors <= 1 + 1e-6
    scaled = factors >= factor * (1 - 1e-6)
    medium = ~kept & ~scaled
    w_kept = wavelen[kept].max() if kept.any() else 0.0
    w_scaled = wavelen[scaled].min() if scaled.any() else math.inf
    # In the blend, 1/wavelen = (1 - s) / A + s / B with s the smoothing weight.
    s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
    candidates: list[tuple[float, float]] = []
    if medium.sum() >= 2:
        coeffs = np.stack([1 - s, s], axis=1)
        (inv_a, inv_b), *_ = np.linalg.lstsq(coeffs, 1 / wavelen[medium], rcond=None)
        candidates.append((1 / inv_a, 1 / inv_b))
    elif medium.sum() == 1:
        # One equation, two unknowns: try a few A above the blended wave and solve for B.
        wm, sm = float(wavelen[medium][0]), float(s[0])
        for a in (math.sqrt(wm * min(w_scaled, 16 * wm)), wm * (1 + 0.1 * sm), wm * (1 + 0.01 * sm)):
            candidates.append((a, sm / (1 / wm - (1 - sm) / a)))
    elif w_kept > 0 and math.isfinite(w_scaled):
        candidates.append((w_kept ** (1 / 3) * w_scaled ** (2 / 3), w_kept ** (2 / 3) * w_scaled ** (1 / 3)))
    elif w_kept > 0:
        candidates.append((4 * w_kept, 2 * w_kept))
    else:
        candidates.append((w_scaled / 2, w_scaled / 4))
    for a, b in candidates:
        # Without metadata, low_freq_factor = 1 (every Llama 3.x) makes original_ctx = A.
        old_ctx = int(orig_ctx) if orig_ctx else max(1, round(a))
        for digits in (6, 17):  # prefer round numbers (Llama 3.1: 1.0 and 4.0) when they fit
            params = {
                "rope_type": "llama3",
                "rope_theta": theta,
                "factor": factor,
                "low_freq_factor": float(f"{old_ctx / a:.{digits}g}"),
                "high_freq_factor": float(f"{old_ctx / b:.{digits}g}"),
                "original_max_position_embeddings": old_ctx,
            }
            if np.allclose(_llama3_factors(params, inv_freq), factors, rtol=1e-5, atol=1e-6):
                return params
    raise ValueError(
        f"GGUF file {path}: its rope_freqs tensor does not match Llama 3 rope scaling; this "
        f"rope scaling is not supported"
    )


def _llama3_factors(params: dict[str, Any], inv_freq: np.ndarray) -> np.ndarray:
    old_ctx = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, out)
    return np.where(wavelen > old_ctx / low, factor, out)


def _rope_parameters(reader: GGUFReader, arch: str, head_dim: int, path: str) -> dict[str, Any]:
    theta = float(_meta(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_dim = _meta(reader, f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim and not GGUF_ARCHES[arch].latent_heads:
        if not GGUF_ARCHES[arch].partial_rotary:
            raise ValueError(
                f"GGUF file {path}: partial rotary embeddings ({arch}.rope.dimension_count={rope_dim}, "
                f"head_dim={head_dim}) are not supported"
            )
        return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": int(rope_dim) / head_dim}
    scaling = _meta(reader, f"{arch}.rope.scaling.type")
    factor = _meta(reader, f"{arch}.rope.scaling.factor")
    orig_ctx = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        return _llama3_from_rope_freqs(
            _to_torch(rope_freqs).float().numpy(), theta, head_dim, orig_ctx, path
        )
    if scaling in (None, "none") or factor in (None, 1.0):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if scaling == "yarn":
        params: dict[str, Any] = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor)}
        if orig_ctx is not None:
            params["original_max_position_embeddings"] = int(orig_ctx)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("attn_factor", "attention_factor")):
            value = _meta(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                params[hf_key] = float(value)
        return params
    raise ValueError(
        f"GGUF file {path}: {arch}.rope.scaling.type={scaling!r} is not supported "
        f"(supported: none, linear, yarn, and llama3 via a rope_freqs tensor)"
    )


def gguf_config(path: str) -> PretrainedConfig:
    """A transformers config built from the file's metadata (never transformers' GGUF guesswork:
    its llama mapping drops rope scaling)."""
    reader = open_gguf(path)
    arch = _architecture(reader, path)
    names = _tensor_names(reader)
    hidden = int(_require(reader, f"{arch}.embedding_length", path))
    heads = int(_require(reader, f"{arch}.attention.head_count", path))
    kv_heads = int(_meta(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", hidden // heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = len(tokens.data)
    else:
        vocab = int(_meta(reader, f"{arch}.vocab_size", 0)) or int(
            next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1]
        )
    ids = {
        k: int(_meta(reader, f"tokenizer.ggml.{g}_token_id"))
        for k, g in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))
        if _meta(reader, f"tokenizer.ggml.{g}_token_id") is not None
    }
    spec = GGUF_ARCHES[arch]
    fields = dict(
        architectures=[spec.architecture],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length", path)),
        num_hidden_layers=int(_require(reader, f"{arch}.block_count", path)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=_rope_parameters(reader, arch, head_dim, path),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        **ids,
    )
    config_tensors = {t.name: _to_torch(t).float().numpy() for t in reader.tensors if t.name in spec.config_tensors}
    fields.update(spec.config_extra(lambda key, default=None: _meta(reader, f"{arch}.{key}", default),
                                    config_tensors, fields, names))
    return getattr(transformers, spec.config_class)(**fields)


_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def gguf_generation_config(path: str) -> dict[str, Any]:
    """What a generation_config.json would hold: special token ids and any recommended sampling."""
    reader = open_gguf(path)
    out: dict[str, Any] = {}
    for g, hf in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        value = _meta(reader, f"tokenizer.ggml.{g}_token_id")
        if value is not None:
            out[hf] = int(value)
    for key, hf in _SAMPLING_KEYS.items():
        value = _meta(reader, key)
        if value is not None:
            out[hf] = value
    return out


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> tuple[str, str | None]:
    """(HF parameter name, un-permute kind 'q'/'kv'/None) for a GGUF tensor name of architecture `arch`."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name], None
    m = _LAYER_RE.match(gguf_name)
    own = GGUF_ARCHES[arch].layer_tensors
    if m and m.group(2) in own:
        return f"model.layers.{m.group(1)}.{own[m.group(2)]}", None
    if m and m.group(2) in _LAYER_TENSORS:
        suffix, kind = _LAYER_TENSORS[m.group(2)]
        return f"model.layers.{m.group(1)}.{suffix}", kind
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent")


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (it interleaves the two rotary halves of each head)."""
    out = w.shape[0]
    return (
        w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
        .contiguous()
    )


def _yield_dtype(qtype: GGMLQuantizationType) -> torch.dtype:
    if qtype == GGMLQuantizationType.F16:
        return torch.float16
    if qtype == GGMLQuantizationType.BF16:
        return torch.bfloat16
    return torch.float32  # F32 as stored; quantized types dequantize to float32


def _to_torch(t: Any) -> torch.Tensor:
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
    qtype = t.tensor_type
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(t.data, dtype=np.float16)).reshape(shape)
    if qtype == GGMLQuantizationType.BF16:
        raw = np.ascontiguousarray(t.data).view(np.int16).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    try:
        arr = dequantize(t.data, qtype)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name}: type {qtype.name} cannot be dequantized") from e
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


def mxfp4_blocks(t: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGML MXFP4 tensor [..., K] as HF's packed pair (model/layers/mxfp4.py): blocks [..., K/32, 16], scales
    [..., K/32]. A GGML block is its E8M0 scale byte and 16 bytes holding element j in byte j's low nibble and
    j + 16 in its high one; HF packs elements 2j, 2j + 1 into byte j. The 4-bit codes and the scale byte mean the
    same in both (GGML stores the E2M1 values doubled and halves the scale)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1, 17)
    q = raw[:, 1:]
    codes = np.concatenate([q & 0x0F, q >> 4], axis=1)  # element order 0..31
    blocks = codes[:, 0::2] | (codes[:, 1::2] << 4)
    groups = (*shape[:-1], shape[-1] // 32)
    return (torch.from_numpy(np.ascontiguousarray(blocks)).reshape(*groups, 16),
            torch.from_numpy(raw[:, 0].copy()).reshape(groups))


def iter_gguf_weights(
    path: str, config: PretrainedConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter tensor of the file, dequantized and un-permuted (an architecture's
    MXFP4 tensors packed as its checkpoints hold them, where it takes them so)."""
    spec = GGUF_ARCHES[_architecture(open_gguf(path), path)]
    weights = _iter_tensors(path, config, dtype)
    return spec.regroup(weights) if spec.regroup is not None else weights


def _iter_tensors(path: str, config: PretrainedConfig, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    reader = open_gguf(path)
    arch = _architecture(reader, path)
    spec = GGUF_ARCHES[arch]
    heads = {"q": config.num_attention_heads, "kv": config.num_key_value_heads}
    part_of = {part: joined for joined, (parts, _) in spec.joined_tensors.items() for part in parts}
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a joined tensor's HF name -> its parts read so far
    for t in reader.tensors:
        if t.name in _CONFIG_ONLY_TENSORS or t.name in spec.config_tensors:
            continue
        name, kind = hf_tensor_name(t.name, arch)
        if spec.packed_mxfp4 and t.tensor_type == GGMLQuantizationType.MXFP4:
            blocks, scales = mxfp4_blocks(t)
            yield name + "_blocks", blocks
            yield name + "_scales", scales
            continue
        w = _to_torch(t)
        suffix = t.name.split(".", 2)[-1]
        if suffix in part_of:
            parts, join = spec.joined_tensors[part_of[suffix]]
            got = pending.setdefault(name, {})
            got[suffix] = w
            if len(got) < len(parts):
                continue
            del pending[name]
            w = join([got[p] for p in parts])
        if kind is not None and spec.permuted_qk:
            w = unpermute_rotary(w, heads[kind])
        if spec.norm_shift and t.name.endswith("norm.weight"):
            # Subtracted in float64, rounded once: the model's 1 + w gives back the file's value (to the bit
            # where it is 1 or more).
            w = (w.double() - spec.norm_shift).to(w.dtype)
        if "{e}" in name:  # a stack of experts [E, ...]: one tensor per expert, as HF checkpoints hold them
            for e, piece in enumerate(w.unbind(0)):  # copies: the cache's safetensors refuses shared storage
                yield name.format(e=e), piece.to(dtype or piece.dtype, copy=True)
            continue
        if dtype is not None and w.dtype != dtype:
            w = w.to(dtype)
        yield name, w


def gguf_hf_types(path: str) -> dict[str, str]:
    """HF parameter name -> the GGUF type (`Q4_K`, `F32`, ...) of the file's tensor behind it, for every parameter
    tensor; a stack of experts under its `{e}` name."""
    reader = open_gguf(path)
    arch = _architecture(reader, path)
    config_tensors = GGUF_ARCHES[arch].config_tensors
    return {hf_tensor_name(t.name, arch)[0]: t.tensor_type.name for t in reader.tensors
            if t.name not in _CONFIG_ONLY_TENSORS and t.name not in config_tensors}


def count_types(hf_types: dict[str, str]) -> dict[str, int]:
    """How many tensors of each GGUF type, most first."""
    counts: dict[str, int] = {}
    for t in hf_types.values():
        counts[t] = counts.get(t, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


FLOAT_TYPES = ("F32", "F16", "BF16")
# Quantized GGUF types of at most ~4.5 bits per weight: our int4 (0.75 bytes per weight) holds them at no more
# bytes; the 5-8 bit ones (Q5_x, Q6_K, Q8_0) lose less on int8.
FOUR_BITS_OR_FEWER = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "IQ4_XS", "IQ4_NL", "IQ1_S", "IQ1_M", "IQ2_XXS",
                       "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4")


def suggested_quantization(types: dict[str, int]) -> str | None:
    """The weight-only scheme closest to the file's most common quantized type (None: no quantized tensor)."""
    quantized = [t for t in types if t not in FLOAT_TYPES]
    if not quantized:
        return None
    return "int4" if max(quantized, key=lambda t: types[t]) in FOUR_BITS_OR_FEWER else "int8"


def gguf_weight_bytes(path: str, dtype: torch.dtype | None = None) -> int:
    """Bytes of the tensors iter_gguf_weights(path, ..., dtype) yields, computed from the header."""
    reader = open_gguf(path)
    spec = GGUF_ARCHES[_architecture(reader, path)]
    total = 0
    for t in reader.tensors:
        if t.name in _CONFIG_ONLY_TENSORS or t.name in spec.config_tensors:
            continue
        if spec.packed_mxfp4 and t.tensor_type == GGMLQuantizationType.MXFP4:
            total += int(t.n_bytes)  # kept packed: the file's bytes
            continue
        itemsize = dtype.itemsize if dtype is not None else _yield_dtype(t.tensor_type).itemsize
        total += int(t.n_elements) * itemsize
    return total
