"""The Qwen3-VL vision tower: patch embedding (temporal patches), learned position embeddings resampled
to each grid, 2D rotary attention isolated per image or frame, the patch merger and the deepstack mergers.

The tower takes fixed-shape tensors only (`VisionInputs`, built on the host by preprocessing.py), so one
graph serves every set of images that fits its patch bucket: images and frames are packed into blocks
(block_packing.py) that attend only within themselves; padding patches carry segment id -1 and attend
only among themselves. Parameter names equal transformers' (`model.visual.*`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from vllm_neuron.model.layers.linear import EncoderLinear
from vllm_neuron.model.qwen3_vl.config import VisionArchConfig
from vllm_neuron.model.qwen3_vl.vision_parallel import VisionParallel, dp_gather_rows, dp_share, tp_all_reduce


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    """With encoder TP, this rank's heads (vision_parallel.py)."""

    def __init__(self, cfg: VisionArchConfig, vp: VisionParallel) -> None:
        super().__init__()
        if cfg.num_heads % vp.tp:
            raise ValueError(f"encoder_neuron_config tp_size={vp.tp} must divide the vision tower's "
                             f"{cfg.num_heads} attention heads")
        self.vp = vp
        self.num_heads = cfg.num_heads // vp.tp
        self.head_dim = cfg.hidden_size // cfg.num_heads
        local = self.num_heads * self.head_dim
        # The checkpoint stores q, k and v stacked as [Q_all | K_all | V_all]: one matmul, split by rows.
        self.qkv = EncoderLinear(cfg.hidden_size, 3 * local, bias=True)
        self.proj = EncoderLinear(local, cfg.hidden_size, bias=True)

    def forward(self, x, cos, sin, mask) -> torch.Tensor:
        """x [P, hidden] holding mask.shape[0] blocks of mask.shape[-1] patches; attention within blocks."""
        n = x.shape[0]
        blocks, size = mask.shape[0], mask.shape[-1]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        dtype = q.dtype
        # Rotary in fp32, like the reference.
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(dtype)
        q, k, v = (t.reshape(blocks, size, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [blocks, heads, size, head_dim]
        return tp_all_reduce(self.proj(out.transpose(1, 2).reshape(n, -1)), self.vp)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionArchConfig, vp: VisionParallel) -> None:
        super().__init__()
        if cfg.intermediate_size % vp.tp:
            raise ValueError(f"encoder_neuron_config tp_size={vp.tp} must divide the vision tower's intermediate "
                             f"size {cfg.intermediate_size}")
        self.vp = vp
        self.linear_fc1 = EncoderLinear(cfg.hidden_size, cfg.intermediate_size // vp.tp, bias=True)
        self.linear_fc2 = EncoderLinear(cfg.intermediate_size // vp.tp, cfg.hidden_size, bias=True)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.linear_fc2(self.act(self.linear_fc1(x))), self.vp)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionArchConfig, vp: VisionParallel) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg, vp)
        self.mlp = VisionMLP(cfg, vp)

    def forward(self, x, cos, sin, mask) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each group of merge_unit neighbouring patches (consecutive rows) -> one text-sized token. The main
    merger normalizes each patch first; the deepstack mergers normalize the concatenated group."""

    def __init__(self, cfg: VisionArchConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = EncoderLinear(self.merged, self.merged)
        self.linear_fc2 = EncoderLinear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged)) if self.postshuffle_norm else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """A Conv3d whose stride equals its kernel is a matmul over flattened patches: kept as one Linear
    (the checkpoint's [hidden, C, T, P, P] kernel is flattened at load)."""

    def __init__(self, cfg: VisionArchConfig) -> None:
        super().__init__()
        self.proj = EncoderLinear(cfg.patch_dim, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Qwen3VLVisionModel(nn.Module):
    def __init__(self, cfg: VisionArchConfig, vp: VisionParallel = VisionParallel()) -> None:
        super().__init__()
        self.cfg, self.vp = cfg, vp
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg, vp) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList([PatchMerger(cfg, postshuffle_norm=True)
                                                    for _ in cfg.deepstack_visual_indexes])
        spatial = cfg.hidden_size // cfg.num_heads // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, rot_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rot_pos [P, 2] (row, column) -> cos, sin [P, 1, head_dim] in fp32 (h and w halves, repeated)."""
        freqs = rot_pos[..., None].float() * self.inv_freq  # [P, 2, head_dim / 4]
        freqs = freqs.reshape(freqs.shape[0], -1)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    def forward(self, pixels, interp_idx, interp_w, rot_pos, segment) -> tuple[torch.Tensor, torch.Tensor]:
        """pixels [P, patch_dim], interp_idx / interp_w [P, 4] (bilinear taps into pos_embed), rot_pos [P, 2],
        segment [blocks, block_size] (P = blocks x block_size; a patch attends to the patches of its block with
        the same segment id) -> (embeds [P / merge_unit, out_hidden],
        deepstack [len(deepstack_visual_indexes), P / merge_unit, out_hidden]). With encoder DP each rank runs
        its share of the blocks and the results are gathered."""
        if self.vp.dp > 1:
            share = dp_share(segment.shape[0], self.vp)
            size = segment.shape[1]
            patches = slice(share.start * size, share.stop * size)
            pixels, interp_idx, interp_w, rot_pos = (t[patches] for t in (pixels, interp_idx, interp_w, rot_pos))
            segment = segment[share]
        x = self.patch_embed(pixels.to(self.patch_embed.proj.weight.dtype))
        x = x + (self.pos_embed(interp_idx) * interp_w[..., None].to(x.dtype)).sum(1)
        cos, sin = self.rotary(rot_pos)
        mask = (segment[:, :, None] == segment[:, None, :])[:, None]  # [blocks, 1, size, size]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask)
            if i in self.cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        embeds = self.merger(x)
        if self.vp.dp > 1:  # one gather of the embeddings and deepstack rows side by side
            n, width = embeds.shape
            rows = dp_gather_rows(torch.cat([embeds, *deepstack], dim=1), self.vp)
            embeds, deepstack = rows[:, :width], list(rows[:, width:].split(width, dim=1))
        stacked = torch.stack(deepstack) if deepstack else embeds.new_zeros((0,) + tuple(embeds.shape))
        return embeds, stacked
