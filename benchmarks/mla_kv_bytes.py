"""KV bytes per token of DeepSeek-V2-Lite with MLA's latent cache against the same model expanded to plain
multi-head attention, and how many 8k-token requests a 16 GiB pool holds each way (issue 52's measure).

    python benchmarks/mla_kv_bytes.py [--dtype-bytes 2] [--pool-gib 16] [--tokens 8192]

The config is DeepSeek-V2-Lite's published shape (27 layers, 16 heads, kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128), built locally; MLA's bytes come from our model's ModelSpec and the
runner's block arithmetic (worker/memory.py), the expansion's from its per-head K (nope + rope) and V widths.
"""
from __future__ import annotations

import argparse

from transformers import DeepseekV2Config

from vllm_neuron.model.deepseek_v2.model import DeepseekV2ForCausalLM
from vllm_neuron.worker.memory import kv_cache_bytes_per_block

V2_LITE = dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
               num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
               num_experts_per_tok=6, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, head_dim=64, first_k_dense_replace=1, vocab_size=102400,
               max_position_embeddings=163840,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                    original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=0.707,
                                    mscale_all_dim=0.707))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per cached element (bf16: 2)")
    ap.add_argument("--pool-gib", type=float, default=16.0)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per request")
    a = ap.parse_args()
    hf = DeepseekV2Config(**V2_LITE)
    spec = DeepseekV2ForCausalLM.spec(hf)
    block = 16
    mla = kv_cache_bytes_per_block(spec.num_layers, spec.num_kv_heads, spec.head_dim, block, a.dtype_bytes)
    mla = (mla // 2 if spec.values_are_keys else mla) // block
    heads, k_dim, v_dim = hf.num_attention_heads, hf.qk_nope_head_dim + hf.qk_rope_head_dim, hf.v_head_dim
    mha = spec.num_layers * heads * (k_dim + v_dim) * a.dtype_bytes
    mha_padded = kv_cache_bytes_per_block(spec.num_layers, heads, k_dim, block, a.dtype_bytes) // block
    pool = a.pool_gib * 2**30
    print(f"DeepSeek-V2-Lite, {spec.num_layers} layers, {a.dtype_bytes}-byte elements; requests of {a.tokens} tokens "
          f"in a {a.pool_gib:g} GiB pool")
    print("| cache | bytes per token | KiB per token | requests |")
    print("| --- | --- | --- | --- |")
    for name, b in (("MLA latent (ours)", mla), ("MHA, K 192 + V 128 per head", mha),
                    ("MHA, V padded to K's 192", mha_padded)):
        print(f"| {name} | {b:,} | {b / 1024:.1f} | {int(pool // (b * a.tokens))} |")
    print(f"MLA holds {mha / mla:.1f}x fewer bytes per token than the MHA expansion")


if __name__ == "__main__":
    main()
