"""Issue 51's measurement: transcription real-time factor (audio seconds per wall second) of a model of
Qwen3-ASR-0.6B's shape with random weights, for one 30 s clip and for 8 clips at once, offline `LLM.generate`
against transformers' `generate` on the same clips, same dtype, same number of generated tokens (EOS ignored).

    python benchmarks/asr_rtf.py [--seconds 30] [--batches 1 8] [--max-new 96] [--dtype bfloat16] [--eager]

The shape (text: Qwen3-0.6B's decoder; audio: an 18-layer 896-wide encoder) is written out with random weights
and the SmolLM2 tokenizer plus the audio tokens (token ids past its vocabulary decode to nothing: speed only).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.asr_factory import AUDIO_PAD, CHAT_TEMPLATE, SPECIAL, asr_prompt, tone  # noqa: E402
from tests.model_factory import EOS_ID, smollm2_tokenizer_dir  # noqa: E402

TEXT = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536,
            rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
AUDIO = dict(model_type="qwen3_asr_encoder", num_mel_bins=128, encoder_layers=18, encoder_attention_heads=14,
             encoder_ffn_dim=3584, d_model=896, downsample_hidden_size=480, output_dim=1024, n_window=50,
             n_window_infer=800, max_position_embeddings=13)


def build(path: str, dtype: torch.dtype):
    from transformers import AutoTokenizer, Qwen3ASRConfig, Qwen3ASRFeatureExtractor, Qwen3ASRForConditionalGeneration

    cfg = Qwen3ASRConfig(architectures=["Qwen3ASRForConditionalGeneration"], text_config=TEXT, audio_config=AUDIO,
                         audio_token_id=AUDIO_PAD, pad_token_id=EOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ASRForConditionalGeneration(cfg).to(dtype).eval()
    model.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    Qwen3ASRFeatureExtractor().save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e6:.0f}M parameters ({dtype})", flush=True)
    return model, tok


def hf_generate(model, tok, clips: list[np.ndarray], max_new: int) -> float:
    from transformers import Qwen3ASRFeatureExtractor

    fe = Qwen3ASRFeatureExtractor()
    ids = tok.encode(asr_prompt("English"))
    t0 = time.perf_counter()
    feats = fe(clips, sampling_rate=16000, padding="longest", return_attention_mask=True, return_tensors="pt")
    n = int(model.get_audio_features(feats["input_features"].to(model.dtype)[:1],
                                     feats["attention_mask"][:1]).pooler_output.shape[0])
    full = [t for i in ids for t in ([i] * n if i == AUDIO_PAD else [i])]
    with torch.no_grad():
        model.generate(torch.tensor([full] * len(clips)), attention_mask=torch.ones(len(clips), len(full), dtype=torch.long),
                       input_features=feats["input_features"].to(model.dtype),
                       input_features_mask=feats["attention_mask"], max_new_tokens=max_new, min_new_tokens=max_new,
                       do_sample=False, pad_token_id=EOS_ID)
    return time.perf_counter() - t0


def ours(path: str, clips_by_batch: dict[int, list[np.ndarray]], max_new: int, dtype: str, eager: bool) -> dict:
    from vllm_neuron import LLM, SamplingParams

    blocks = max(len(c) for c in clips_by_batch.values()) * 4
    llm = LLM(path, dtype=dtype, max_model_len=1024, max_num_seqs=8, enforce_eager=eager,
              additional_config={"encoder_neuron_config": {"encoder_attention_block_size": 128,
                                                           "num_encoder_input_buckets": sorted({4, blocks})},
                                 "neuron_config": {"num_seqs_buckets": [1, 8]}})
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    out = {}
    for batch, clips in clips_by_batch.items():
        prompts = [{"prompt": asr_prompt("English"), "multi_modal_data": {"audio": (c, 16000)}} for c in clips]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        out[batch] = time.perf_counter() - t0
        assert all(len(r.outputs[0].token_ids) == max_new for r in res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--eager", action="store_true", help="our engine without compiled graphs")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    clips = {b: [tone(args.seconds, 200.0 + 60 * i, seed=i) for i in range(b)] for b in args.batches}
    with tempfile.TemporaryDirectory() as path:
        model, tok = build(path, dtype)
        rows = []
        if not args.skip_ours:
            t = ours(path, clips, args.max_new, args.dtype, args.eager)
            for b in args.batches:
                rows.append(("vllm-neuron" + (" (eager)" if args.eager else ""), b, t[b]))
        if not args.skip_hf:
            for b in args.batches:
                rows.append(("transformers generate", b, hf_generate(model, tok, clips[b], args.max_new)))
    print(f"\n{args.seconds:g} s clips, {args.max_new} tokens each, {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'engine':<26} {'clips':>5} {'wall s':>8} {'RTF (audio s / wall s)':>24}")
    for name, b, wall in rows:
        print(f"{name:<26} {b:>5} {wall:>8.2f} {b * args.seconds / wall:>24.2f}")


if __name__ == "__main__":
    main()
