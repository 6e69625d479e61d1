"""Step 4: speed, bf16, compiled graphs, Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, tied embeddings) with the SmolLM2 tokenizer's 49152-token vocabulary (random weights).
(a) batch-1 decode TPOT vs the HBM roofline; (b) 64 x 256-token prompts -> 128 tokens, ours vs transformers."""
import json
import os
import sys
import time
import traceback

import gpucommon as G

DEV = os.environ.get("SPEED_DEVICE", "cuda")
SMALL = os.environ.get("SPEED_SMALL") == "1"  # CPU dry run of the script's logic only
PATH = "/tmp/llama1b" if not SMALL else "/tmp/llama_small"
HBM = 4.8e12
N_PROMPTS, PROMPT_LEN, OUT_LEN = (64, 256, 128) if not SMALL else (8, 256, 16)
B1_PROMPT, B1_OUT = (128, 256) if not SMALL else (128, 16)

import torch  # noqa: E402


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64) if not SMALL else dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64)
    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=49152, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}, **kw)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        g = torch.Generator(device=DEV).manual_seed(0)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
    model = model.eval()
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return model


G.banner("step 4: speed (bf16, compiled)")
res = {}
try:
    t0 = time.time()
    hf = build_model()
    os.makedirs(PATH, exist_ok=True)
    hf.save_pretrained(PATH)
    G.copy_tokenizer(PATH)
    n_params = sum(p.numel() for p in hf.parameters())  # tied: embedding counted once
    emb = hf.model.embed_tokens.weight.numel()
    # Bytes a decode step must stream: every weight once; the embedding table is read for 1 row as a
    # lookup but in full as the (tied) lm_head.
    weight_bytes = n_params * 2
    roofline_ms = weight_bytes / HBM * 1e3
    print("model built+saved in %.1f s: %.3f B params (embedding %.1f M, tied), %.3f GB bf16; roofline %.3f ms/token"
          % (time.time() - t0, n_params / 1e9, emb / 1e6, weight_bytes / 1e9, roofline_ms))
    res.update(params=n_params, weight_bytes=weight_bytes, roofline_ms=roofline_ms)
except Exception:
    traceback.print_exc()
    G.result("4 model build", False)
    sys.exit(0)

from vllm_neuron import LLM, SamplingParams  # noqa: E402

b1_prompt = G.random_prompts([B1_PROMPT], seed=7)[0]
tp_prompts = G.random_prompts([PROMPT_LEN] * N_PROMPTS, seed=11)

try:
    G.banner("ours: engine start (compile)")
    t0 = time.time()
    llm = LLM(PATH, device=DEV, dtype="bfloat16", max_model_len=1024, max_num_seqs=N_PROMPTS,
              max_num_batched_tokens=2048, enable_prefix_caching=False,
              enforce_eager=os.environ.get("SPEED_EAGER") == "1",
              additional_config={"neuron_config": {"num_seqs_buckets": [1, N_PROMPTS],
                                                   "num_batched_tokens_buckets": [2048]}})
    init_s = time.time() - t0
    core = llm.llm_engine.core
    recs = core.compiler.records
    print("engine init %.1f s (startup_seconds %.1f), runner %s, async %s, num_blocks %d, graphs:"
          % (init_s, core.startup_seconds, type(core.runner).__name__, core.async_scheduling, core.num_blocks))
    print("paged decode kernel %s, CUDA graphs %s" % (getattr(core.runner, "paged_decode", None),
                                                     getattr(core.runner, "graph_capture", None)))
    for r in recs:
        print("  ", r)
    res.update(init_s=init_s, compile_s={r.name: round(r.seconds, 2) for r in recs})
    if DEV == "cuda":
        print("GPU memory allocated %.1f GiB, reserved %.1f GiB" % (torch.cuda.memory_allocated() / 2**30,
                                                                    torch.cuda.memory_reserved() / 2**30))

    def timed(prompts, n_out):
        sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        sync()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        sync()
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == n_out for o in outs), [len(o.outputs[0].token_ids) for o in outs]
        return dt

    G.banner("ours: (a) batch-1 decode")
    timed([b1_prompt], 8)  # warm
    t1s, tns = [], []
    for _ in range(2):
        t1s.append(timed([b1_prompt], 1))
        tns.append(timed([b1_prompt], B1_OUT))
    tpot = (min(tns) - min(t1s)) / (B1_OUT - 1) * 1e3
    print("t(1 token) %s s; t(%d tokens) %s s -> TPOT %.3f ms = %.1f%% of roofline (%.3f ms); TTFT~%.1f ms"
          % ([round(x, 4) for x in t1s], B1_OUT, [round(x, 3) for x in tns], tpot, roofline_ms / tpot * 100,
             roofline_ms, min(t1s) * 1e3))
    res.update(tpot_ms=tpot, pct_roofline=roofline_ms / tpot * 100, ttft_ms=min(t1s) * 1e3)
    G.result("4a batch-1 TPOT", True, "%.3f ms/token, %.1f%% of HBM roofline" % (tpot, roofline_ms / tpot * 100))

    # Graph alone: the batch-1 decode graph on dummy rows, no scheduler / detokenizer.
    try:
        runner = core.runner
        ctx = runner.context_buckets[-1]
        for _ in range(3):
            runner._run_decode([], 1, ctx)
        sync()
        n = 50
        t = time.perf_counter()
        for _ in range(n):
            runner._run_decode([], 1, ctx)
        sync()
        g_ms = (time.perf_counter() - t) / n * 1e3
        print("decode_b1 graph alone: %.3f ms/step (%.1f%% of roofline), context bucket %d" % (g_ms, roofline_ms / g_ms * 100, ctx))
        res.update(graph_b1_ms=g_ms)
        if DEV == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    runner._run_decode([], 1, ctx)
                sync()
            ka = prof.key_averages()
            try:
                print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
            except Exception:
                print(ka.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
            kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
                       and str(e.device_type).endswith("CUDA")]
            print("CUDA kernel events in 5 steps: %d (%.0f per step)" % (len(kernels), len(kernels) / 5))
    except Exception:
        traceback.print_exc()

    G.banner("ours: (b) throughput 64 x 256 -> 128")
    tp = []
    for _ in range(2):
        dt = timed(tp_prompts, OUT_LEN)
        tp.append(N_PROMPTS * OUT_LEN / dt)
        print("  %.2f s -> %.0f output tok/s (%.0f total tok/s)" % (dt, tp[-1], N_PROMPTS * (OUT_LEN + PROMPT_LEN) / dt))
    res.update(ours_tok_s=tp)
    G.result("4b ours throughput", True, "%.0f output tok/s (best of 2)" % max(tp))
    st = core.scheduler
    print("preemptions", getattr(st, "num_preemptions", None))
except Exception:
    traceback.print_exc()
    G.result("4 ours speed", False, "exception")

try:
    G.banner("transformers generate, same model (bf16, sdpa)")
    print("attn impl", getattr(hf.config, "_attn_implementation", None))

    def hf_gen(ids, n):
        x = torch.tensor(ids, device=DEV)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=2)
        sync()
        assert out.shape[1] == x.shape[1] + n
        return time.perf_counter() - t

    hf_gen([b1_prompt], 4)
    a1 = min(hf_gen([b1_prompt], 1) for _ in range(2))
    an = min(hf_gen([b1_prompt], B1_OUT) for _ in range(1))
    hf_tpot = (an - a1) / (B1_OUT - 1) * 1e3
    print("HF batch-1 TPOT %.3f ms (%.1f%% of roofline)" % (hf_tpot, res.get("roofline_ms", 0) / hf_tpot * 100))
    hf_gen(tp_prompts[:N_PROMPTS], 2)
    dt = hf_gen(tp_prompts, OUT_LEN)
    hf_tp = N_PROMPTS * OUT_LEN / dt
    print("HF throughput: %.2f s -> %.0f output tok/s" % (dt, hf_tp))
    res.update(hf_tpot_ms=hf_tpot, hf_tok_s=hf_tp)
    G.result("4c transformers baseline", True, "TPOT %.3f ms, %.0f output tok/s" % (hf_tpot, hf_tp))
except Exception:
    traceback.print_exc()
    G.result("4c transformers baseline", False, "exception")
print("SPEED_JSON", json.dumps(res))
G.save_json("speed", res)
sys.stdout.flush()
os._exit(0)
