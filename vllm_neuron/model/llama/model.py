"""Llama (SmolLM2, Llama 3.x) on static shapes and a paged KV cache; the base of the Qwen3 family.

Parameter names equal transformers' so checkpoints load by name. The model knows tokens, positions and
KV slots, never requests. Subclasses change the arch config (`arch_config`) and a layer's MLP
and attention (`LlamaDecoderLayer.make_mlp` / `make_attention`).
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.model.base import CausalLM, ModelSpec, Target
from vllm_neuron.model.layer_region import layer_region
from vllm_neuron.model.layers.activation import silu_and_mul
from vllm_neuron.model.layers.attention import AttentionMetadata, paged_attention
from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.norm import RMSNorm
from vllm_neuron.model.layers.parallel import (VocabParallelEmbedding, all_reduce, gather_last_dim,
                                               mark_added_once, mark_split, split_size, tp_world)
from vllm_neuron.model.layers.rotary import RotaryEmbedding, apply_rotary
from vllm_neuron.model.llama.config import LlamaArchConfig
from vllm_neuron.model.llama.weight_loaders import llama_checkpoint_target
from vllm_neuron.model.layers.pipeline_ops import recv_logits, share_logits
from vllm_neuron.model.pipeline_stage import AbsentLayer, holds_embedding, stage_forward, stage_holds_tensor


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaArchConfig) -> None:
        super().__init__()
        # Tensor parallelism: this rank's query heads and KV heads (parallel_state.local_kv_heads).
        self.num_heads = split_size(cfg.num_heads, "the number of attention heads")
        self.num_kv_heads = ps.local_kv_heads(cfg.num_kv_heads, tp_world())
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        # q, k and v as one matmul (checkpoint tensors are stacked at load): one weight stream per step.
        self.qkv_sizes = (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.qkv_proj = Linear(h, sum(self.qkv_sizes), bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        if tp_world() > 1:
            mark_split(self.qkv_proj.weight, self.qkv_proj.bias, self.o_proj.weight)
            mark_added_once(self.o_proj.bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = d**-0.5
        self.sliding_window: int | None = None  # set by families with sliding-window layers
        # Per-tensor scales of an FP8 KV cache (kv_quant.py); the checkpoint's when it has them.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, lora_index=None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x, lora_index).split(self.qkv_sizes, dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, getattr(self, "sinks", None),
                              self.sliding_window, self.k_scale, self.v_scale)
        return all_reduce(self.o_proj(out, lora_index))


class LlamaMLP(nn.Module):
    kernels = KernelConfig()  # the engine's, set when the model is built (kernel_config.apply_kernel_config)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        intermediate_size = split_size(intermediate_size, "the MLP intermediate size")
        self.gate_up_sizes = (intermediate_size, intermediate_size)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        if tp_world() > 1:
            mark_split(self.gate_up_proj.weight, self.gate_up_proj.bias, self.down_proj.weight)
            mark_added_once(self.down_proj.bias)

    def forward(self, x: torch.Tensor, lora_index: torch.Tensor | None = None) -> torch.Tensor:
        h = silu_and_mul(self.gate_up_proj(x, lora_index), self.kernels.activation)
        return all_reduce(self.down_proj(h, lora_index))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.make_attention(cfg, layer_idx)
        self.mlp = self.make_mlp(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_attention(self, cfg: LlamaArchConfig, layer_idx: int) -> nn.Module:
        return LlamaAttention(cfg)

    def make_mlp(self, cfg: LlamaArchConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, cos, sin, kv_cache, meta, lora_index=None) -> torch.Tensor:
        if lora_index is not None:
            return _lora_decoder_layer(self, x, cos, sin, kv_cache[0], kv_cache[1], lora_index, *meta.fields())
        return _decoder_layer(self, x, cos, sin, kv_cache[0], kv_cache[1], *meta.fields())


def decoder_layer_body(layer: LlamaDecoderLayer, x, cos, sin, k_cache, v_cache, *meta_fields,
                       lora_index=None) -> torch.Tensor:
    meta = AttentionMetadata(*meta_fields)
    if lora_index is None:  # (layers whose attention / MLP take no adapters: gpt-oss, Qwen3-MoE)
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, (k_cache, v_cache), meta)
        return x + layer.mlp(layer.post_attention_layernorm(x))
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, (k_cache, v_cache), meta, lora_index)
    return x + layer.mlp(layer.post_attention_layernorm(x), lora_index)


@layer_region
def _decoder_layer(layer: LlamaDecoderLayer, x, cos, sin, k_cache, v_cache, *meta_fields) -> torch.Tensor:
    # One nested compile region for every layer (layer_region.py): torch.compile traces and compiles the
    # layer once per graph and stamps it out 30 times (2.5x faster cold compile, 2-3x faster warm load).
    # Layers that differ in a Python constant need a region of their own (gpt-oss's sliding layers).
    return decoder_layer_body(layer, x, cos, sin, k_cache, v_cache, *meta_fields)


@layer_region
def _lora_decoder_layer(layer: LlamaDecoderLayer, x, cos, sin, k_cache, v_cache, lora_index,
                        *meta_fields) -> torch.Tensor:
    # With LoRA every layer also takes each token's adapter slot (model/layers/lora.py).
    return decoder_layer_body(layer, x, cos, sin, k_cache, v_cache, *meta_fields, lora_index=lora_index)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, hf_config, layer_cls: type[LlamaDecoderLayer]) -> None:
        super().__init__()
        # Pipeline parallelism: this rank's stage builds its own layers only (model/pipeline_stage.py).
        self.stage = ps.info().stage(cfg.num_layers)
        self.micro_batches = ps.info().pp_micro_batches  # a decode step's pieces between stages
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) \
            if holds_embedding(self.stage, cfg.tie_word_embeddings) else None
        self.layers = nn.ModuleList([layer_cls(cfg, i) if self.stage.holds(i) else AbsentLayer()
                                     for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(hf_config, cfg.max_position_embeddings)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None, aux_layers: tuple[int, ...] = (),
                lora_index=None):
        if self.stage.pp_size > 1:
            return self._stage_forward(input_ids, positions, kv_caches, meta, inputs_embeds)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary(positions, x.dtype)
        metas = meta if isinstance(meta, (list, tuple)) else [meta] * len(self.layers)
        taps = {}
        for i, (layer, kv_cache, m) in enumerate(zip(self.layers, kv_caches, metas)):
            if i in aux_layers:
                taps[i] = x
            x = layer(x, cos, sin, kv_cache, m) if lora_index is None else layer(x, cos, sin, kv_cache, m, lora_index)
        taps[len(self.layers)] = x  # tap L: the last layer's output (DFlash's taps are layer outputs)
        if aux_layers:  # EAGLE3 / DFlash: the input hidden states of these layers, side by side
            return self.norm(x), torch.cat([taps[i] for i in aux_layers], dim=-1)
        return self.norm(x)

    def _stage_forward(self, input_ids, positions, kv_caches, meta, inputs_embeds):
        """A pipeline stage's part (model/pipeline_stage.py): its layers, whose KV caches kv_caches holds in order."""
        stage, dtype = self.stage, self.norm.weight.dtype
        cos, sin = self.rotary(positions, dtype)

        def run_layers(x, cos, sin, m):
            metas = m if isinstance(m, (list, tuple)) else [m] * len(stage.layers)  # per layer with KV groups
            for i, kv_cache, layer_meta in zip(stage.layers, kv_caches, metas):
                x = self.layers[i](x, cos, sin, kv_cache, layer_meta)
            return x

        x = stage_forward(stage, run_layers, lambda: self.embed_tokens(input_ids) if inputs_embeds is None
                          else inputs_embeds, positions, cos, sin, meta, self.hidden_size, dtype, self.micro_batches)
        return self.norm(x) if stage.is_last else x


class LlamaForCausalLM(CausalLM):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    model_cls: type[nn.Module] = LlamaModel  # built as model_cls(arch config, hf_config, layer_cls)
    arch_cls: type[LlamaArchConfig] = LlamaArchConfig  # its from_hf(hf_config) is the arch config
    # What subclasses declare in their ModelSpec.
    is_moe = False
    attention_sinks = False
    quantizations: tuple[str, ...] = ("int8", "int4")

    @classmethod
    def arch_config(cls, hf_config) -> LlamaArchConfig:
        return cls.arch_cls.from_hf(hf_config)

    @classmethod
    def spec(cls, hf_config) -> ModelSpec:
        a = cls.arch_config(hf_config)
        windows = getattr(a, "sliding_windows", None) or (None,) * a.num_layers
        return ModelSpec(a.num_layers, a.num_kv_heads, a.head_dim, windows, is_moe=cls.is_moe,
                         attention_sinks=cls.attention_sinks, quantizations=cls.quantizations)

    def __init__(self, hf_config, quantization: str | None = None) -> None:
        """`quantization`: neuron_config.quantization when the model applies it itself (gpt-oss MXFP4)."""
        super().__init__()
        self.arch = self.arch_config(hf_config)
        self.model_spec = self.spec(hf_config)
        self.stage = ps.info().stage(self.arch.num_layers)  # pipeline parallelism (model/pipeline_stage.py)
        self.model = self.model_cls(self.arch, hf_config, self.layer_cls)
        # Split over the vocabulary like the embedding (parallel.py); logits are gathered in compute_logits.
        # Only the last pipeline stage has one.
        self.lm_head = Linear(self.arch.hidden_size, -(-self.arch.vocab_size // tp_world()), bias=False) \
            if self.stage.is_last else None
        if self.lm_head is not None and self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        elif self.lm_head is not None and tp_world() > 1:
            mark_split(self.lm_head.weight)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, inputs_embeds=None,
                aux_layers: tuple[int, ...] = (), lora_index=None):
        """Hidden states [N, hidden] for N (padded) tokens; with `aux_layers` also the input hidden states
        of those layers concatenated, [N, len(aux_layers) * hidden] (EAGLE3's draft features); `lora_index`
        [N]: each token's LoRA adapter slot (0: the base model), with LoRA attached."""
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds, aux_layers, lora_index)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.stage.is_last:  # the last stage's logits of the same rows (pipeline_ops.py)
            return recv_logits(hidden, self.arch.vocab_size)
        logits = gather_last_dim(self.lm_head(hidden), self.arch.vocab_size)
        return logits if self.stage.pp_size == 1 else share_logits(logits)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        s = self.model_spec
        return len(self.stage.layers), ps.local_kv_heads(s.num_kv_heads, tp_world()), s.head_dim

    def checkpoint_target(self, name: str) -> Target | None:
        if not stage_holds_tensor(self.stage, name, self.arch.tie_word_embeddings):
            return None  # another pipeline stage's tensor
        return llama_checkpoint_target(self, name)
