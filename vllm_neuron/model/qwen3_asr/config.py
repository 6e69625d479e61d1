"""Typed views of a Hugging Face Qwen3-ASR config: the audio encoder (a Whisper-style tower behind a
strided conv stack), the text decoder (Qwen3's), the audio placeholder token, and the window arithmetic.

Mel frames are cut into chunks of 2 * n_window frames; three stride-2 convolutions turn a full chunk into
`tokens_per_chunk` (13 for 100 frames) encoder tokens. Attention runs within windows of n_window_infer
frames: `chunks_per_window` chunks, `window_tokens` tokens (8 and 104 for the released checkpoints).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_neuron.config.neuron_config import EncoderNeuronConfig
from vllm_neuron.model.llama.config import LlamaArchConfig

DEFAULT_CLIP_SECONDS = 30.0  # the default encoder bucket holds one clip of this length


def post_conv_length(frames: int) -> int:
    """Encoder tokens of `frames` mel frames of one chunk: three (k=3, s=2, p=1) convolutions; 0 stays 0."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


@dataclass(frozen=True)
class AudioArchConfig:
    num_mel_bins: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    d_model: int
    activation: str
    n_window: int
    n_window_infer: int
    downsample_hidden_size: int
    output_dim: int
    max_position_embeddings: int

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window

    @property
    def chunks_per_window(self) -> int:
        return self.n_window_infer // self.chunk_frames

    @property
    def tokens_per_chunk(self) -> int:
        return post_conv_length(self.chunk_frames)

    @property
    def window_tokens(self) -> int:
        return self.chunks_per_window * self.tokens_per_chunk

    @property
    def conv_freq_bins(self) -> int:
        return post_conv_length(self.num_mel_bins)

    def num_tokens(self, frames: int) -> int:
        """Encoder tokens (= placeholder tokens in the prompt) of a clip of `frames` mel frames."""
        full, rest = divmod(frames, self.chunk_frames)
        return full * self.tokens_per_chunk + post_conv_length(rest)

    def num_windows(self, frames: int) -> int:
        """Attention windows (= encoder blocks) of a clip of `frames` mel frames."""
        chunks = -(-frames // self.chunk_frames)
        return max(1, -(-chunks // self.chunks_per_window))

    @classmethod
    def from_hf(cls, a) -> "AudioArchConfig":
        if a.n_window_infer % (2 * a.n_window):
            raise ValueError(f"audio_config.n_window_infer={a.n_window_infer} must be a multiple of 2 * n_window "
                             f"({2 * a.n_window})")
        if getattr(a, "scale_embedding", False):
            raise ValueError("audio_config.scale_embedding=true is not supported; supported: false")
        if a.max_position_embeddings < post_conv_length(2 * a.n_window):
            raise ValueError(f"audio_config.max_position_embeddings={a.max_position_embeddings} is shorter than "
                             f"one chunk's {post_conv_length(2 * a.n_window)} tokens")
        return cls(num_mel_bins=a.num_mel_bins, num_layers=a.encoder_layers, num_heads=a.encoder_attention_heads,
                   ffn_dim=a.encoder_ffn_dim, d_model=a.d_model, activation=a.activation_function,
                   n_window=a.n_window, n_window_infer=a.n_window_infer,
                   downsample_hidden_size=a.downsample_hidden_size, output_dim=a.output_dim,
                   max_position_embeddings=a.max_position_embeddings)


@dataclass(frozen=True)
class Qwen3ASRArchConfig:
    text: LlamaArchConfig
    audio: AudioArchConfig
    audio_token_id: int

    @classmethod
    def from_hf(cls, hf) -> "Qwen3ASRArchConfig":
        t = hf.get_text_config()
        if getattr(t, "use_sliding_window", False):
            raise ValueError("Qwen3-ASR with use_sliding_window=true is not supported; supported: "
                             "use_sliding_window=false")
        text = LlamaArchConfig.from_hf(t, family="Qwen3-ASR", qk_norm=True)
        # The output layer is tied at the top level of a composite config.
        text = replace(text, tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)))
        audio = AudioArchConfig.from_hf(hf.audio_config)
        if audio.output_dim != text.hidden_size:
            raise ValueError(f"audio_config.output_dim={audio.output_dim} must equal the text hidden_size="
                             f"{text.hidden_size}")
        return cls(text=text, audio=audio, audio_token_id=hf.audio_token_id)


def audio_encoder_buckets(additional_config, cfg: AudioArchConfig) -> list[int]:
    """Encoder input buckets in blocks (one attention window of n_window_infer mel frames per block), from
    encoder_neuron_config: the explicit num_encoder_input_buckets, or the blocks one 30-second clip needs."""
    enc = additional_config.encoder_neuron_config or EncoderNeuronConfig()
    if enc.encoder_attention_block_size < cfg.window_tokens:
        raise ValueError(f"encoder_attention_block_size={enc.encoder_attention_block_size} must hold one audio "
                         f"window of {cfg.window_tokens} tokens ({cfg.n_window_infer} mel frames); use 128")
    buckets = enc.num_encoder_input_buckets
    if buckets is None:
        return [cfg.num_windows(int(DEFAULT_CLIP_SECONDS * 100))]
    bad = [b for b in buckets if not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"num_encoder_input_buckets={list(buckets)} counts encoder blocks for an audio model "
                         f"(one {cfg.n_window_infer}-frame window each); they must be positive integers, got {bad}")
    return sorted(set(buckets))
