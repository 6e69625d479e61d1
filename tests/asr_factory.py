"""A tiny random-weight Qwen3-ASR (transformers' own config and model classes) with the SmolLM2 tokenizer
plus Qwen3-ASR's audio special tokens, a chat template in the checkpoint's prompt format and a Qwen3-ASR
feature extractor config, built locally; and transformers' greedy reference for clips.

    from tests.asr_factory import make_tiny_qwen3_asr, build_tiny_qwen3_asr, hf_asr_greedy, tone
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch

from tests.model_factory import BOS_ID, EOS_ID, SMOLLM2_VOCAB_SIZE, smollm2_tokenizer_dir
from tests.vlm_factory import seed_weights_

AUDIO_START, AUDIO_END, AUDIO_PAD, ASR_TEXT = (SMOLLM2_VOCAB_SIZE + i for i in range(4))
SPECIAL = ["<|audio_start|>", "<|audio_end|>", "<|audio_pad|>", "<asr_text>"]
VOCAB = SMOLLM2_VOCAB_SIZE + 8
MEL_BINS = 32
RATE = 16000
# Qwen3-ASR's prompt: an optional system turn (context), the user turn holding the audio, the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role + '\\n' }}"
    "{%- if message.content is string -%}{{ message.content }}{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type in ('audio', 'audio_url', 'input_audio') -%}<|audio_start|><|audio_pad|><|audio_end|>"
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
AUDIO = "<|audio_start|><|audio_pad|><|audio_end|>"


def asr_prompt(language: str | None = None) -> str:
    lang = f"language {language}<asr_text>" if language else ""
    return f"<|im_start|>user\n{AUDIO}<|im_end|>\n<|im_start|>assistant\n{lang}"


def tiny_qwen3_asr_config(num_hidden_layers: int = 2):
    from transformers import Qwen3ASRConfig

    text = dict(model_type="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, rope_theta=10000.0, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                pad_token_id=EOS_ID, tie_word_embeddings=False)
    audio = dict(model_type="qwen3_asr_encoder", num_mel_bins=MEL_BINS, encoder_layers=2,
                 encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32, downsample_hidden_size=8, output_dim=64,
                 n_window=50, n_window_infer=800, max_position_embeddings=13)
    return Qwen3ASRConfig(architectures=["Qwen3ASRForConditionalGeneration"], text_config=text, audio_config=audio,
                          audio_token_id=AUDIO_PAD, pad_token_id=EOS_ID, eos_token_id=EOS_ID,
                          tie_word_embeddings=False)


@functools.lru_cache(maxsize=2)
def build_tiny_qwen3_asr(seed: int = 0):
    """transformers' Qwen3ASRForConditionalGeneration with seeded unit-scale weights, fp32, eval mode."""
    from transformers import GenerationConfig, Qwen3ASRForConditionalGeneration

    model = seed_weights_(Qwen3ASRForConditionalGeneration(tiny_qwen3_asr_config()), seed)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    return model.eval()


def feature_extractor():
    from transformers import Qwen3ASRFeatureExtractor

    return Qwen3ASRFeatureExtractor(feature_size=MEL_BINS, sampling_rate=RATE)


def make_tiny_qwen3_asr(path: str) -> str:
    """Writes the model, its tokenizer (audio tokens, chat template) and its feature extractor config."""
    from transformers import AutoTokenizer

    os.makedirs(path, exist_ok=True)
    build_tiny_qwen3_asr().save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    assert tok.convert_tokens_to_ids(SPECIAL) == [AUDIO_START, AUDIO_END, AUDIO_PAD, ASR_TEXT]
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    feature_extractor().save_pretrained(path)
    return path


def tone(seconds: float, freq: float = 440.0, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """A tone with a little noise, float32 mono."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    return (0.5 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def hf_audio_inputs(wave: np.ndarray) -> dict:
    """transformers' encoder inputs of one clip (the processor's own extraction, unbatched)."""
    out = feature_extractor()(wave, sampling_rate=RATE, padding="longest", return_attention_mask=True,
                              return_tensors="pt")
    return {"input_features": out["input_features"], "input_features_mask": out["attention_mask"]}


def hf_asr_greedy(ids: list[int], wave: np.ndarray, max_new: int) -> list[int]:
    """transformers greedy tokens after `ids` (one AUDIO_PAD, expanded here to the clip's token count)."""
    model = build_tiny_qwen3_asr()
    inputs = hf_audio_inputs(wave)
    with torch.no_grad():
        n = model.get_audio_features(**inputs).pooler_output.shape[0]
        full = []
        for t in ids:
            full += [t] * n if t == AUDIO_PAD else [t]
        out = model.generate(torch.tensor([full]), **inputs, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=EOS_ID)
    return out[0, len(full):].tolist()
