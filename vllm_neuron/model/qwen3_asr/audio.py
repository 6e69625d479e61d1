"""The Qwen3-ASR audio encoder on fixed-shape inputs: a stride-2 conv stack per mel chunk, sinusoidal
positions per chunk, Whisper-style encoder layers attending within one inference window, then the
projector into the text model's hidden size.

One encoder block is one attention window (`chunks_per_window` chunks, `window_tokens` tokens): the input
is [blocks * chunks_per_window, mel bins, chunk frames] of zero-padded mel chunks and the valid frames of
each chunk, so one compiled graph serves every set of clips whose windows fit its block bucket. Tokens past a
chunk's valid length (the last chunk of a clip, padding chunks) attend to nothing real and are dropped by the
host; a valid token never sees them. Parameter names equal transformers' (`model.audio_tower.*`,
`model.multi_modal_projector.*`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from vllm_neuron.model.layers.linear import EncoderLinear
from vllm_neuron.model.qwen3_asr.config import AudioArchConfig


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's fixed position table [length, channels] (sin half, cos half), in fp32."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


def valid_tokens(chunk_len: torch.Tensor, tokens_per_chunk: int) -> torch.Tensor:
    """[C, tokens_per_chunk] bool: the conv outputs of each chunk that come from its valid frames."""
    n = chunk_len
    for _ in range(3):
        n = torch.where(n > 0, torch.div(n - 1, 2, rounding_mode="floor") + 1, torch.zeros_like(n))
    return torch.arange(tokens_per_chunk, device=chunk_len.device)[None, :] < n[:, None]


class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioArchConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.d_model // cfg.num_heads
        self.q_proj = EncoderLinear(cfg.d_model, cfg.d_model, bias=True)
        self.k_proj = EncoderLinear(cfg.d_model, cfg.d_model, bias=True)
        self.v_proj = EncoderLinear(cfg.d_model, cfg.d_model, bias=True)
        self.out_proj = EncoderLinear(cfg.d_model, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [blocks, W, d]; mask [blocks, 1, W, W] (True: may attend)."""
        b, w, _ = x.shape
        q, k, v = (p(x).reshape(b, w, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, w, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioArchConfig) -> None:
        super().__init__()
        self.self_attn = AudioAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = EncoderLinear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = EncoderLinear(cfg.ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.act = ACT2FN[cfg.activation]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Qwen3ASRAudioEncoder(nn.Module):
    """`model.audio_tower`: mel chunks -> encoder states [blocks * window_tokens, d_model]."""

    def __init__(self, cfg: AudioArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv_out = EncoderLinear(ch * cfg.conv_freq_bins, cfg.d_model, bias=False)
        self.layers = nn.ModuleList([AudioEncoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.register_buffer("positional_embedding", sinusoids(cfg.max_position_embeddings, cfg.d_model),
                             persistent=False)

    def forward(self, mel: torch.Tensor, chunk_len: torch.Tensor) -> torch.Tensor:
        """mel [C, mel bins, chunk frames] (C = blocks * chunks_per_window), chunk_len [C] valid frames."""
        cfg = self.cfg
        x = mel.to(self.conv_out.weight.dtype)[:, None]
        x = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(x))))))
        c, ch, freq, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(c, t, ch * freq))
        x = x + self.positional_embedding[:t].to(x.dtype)
        blocks = c // cfg.chunks_per_window
        x = x.reshape(blocks, cfg.window_tokens, -1)
        valid = valid_tokens(chunk_len, t).reshape(blocks, cfg.window_tokens)
        # A valid query sees the valid keys of its window; an invalid one sees everything (no empty softmax row).
        mask = (valid[:, None, :] | ~valid[:, :, None])[:, None]
        for layer in self.layers:
            x = layer(x, mask)
        return self.ln_post(x).reshape(blocks * cfg.window_tokens, -1)


class Qwen3ASRProjector(nn.Module):
    """`model.multi_modal_projector`: encoder states -> text hidden size."""

    def __init__(self, cfg: AudioArchConfig) -> None:
        super().__init__()
        self.linear_1 = EncoderLinear(cfg.d_model, cfg.d_model)
        self.act = ACT2FN[cfg.activation]
        self.linear_2 = EncoderLinear(cfg.d_model, cfg.output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))
