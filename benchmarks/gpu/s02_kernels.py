"""Step 2a: the CUDA-only pieces against their CPU-tested references: the Triton paged decode kernel
(vs the torch reference and vs SDPA over the whole bucket, including a short context in a long bucket) and
CUDA graph replay of a function with static inputs filled in place (vs running it directly)."""
import os
import sys
import traceback

import gpucommon as G
import torch
import torch.nn.functional as F

G.banner("step 2a: paged decode kernel and graph replay on CUDA")
try:
    from vllm_neuron.model.layers.paged_decode import paged_decode, paged_decode_reference

    torch.manual_seed(0)
    worst = 0.0
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for b, h, kv, d, bs, nblk in ((1, 32, 8, 64, 32, 32), (5, 12, 4, 64, 16, 8), (3, 8, 8, 128, 32, 4)):
            num_slots = (b * nblk + 1) * bs
            kc = torch.randn(num_slots, kv, d, device="cuda", dtype=dtype)
            vc = torch.randn_like(kc)
            tables = torch.randperm(b * nblk, device="cuda").view(b, nblk).to(torch.int32) + 1
            lens = torch.randint(1, nblk * bs + 1, (b,), device="cuda", dtype=torch.int32)
            lens[0] = 1
            q = torch.randn(b, h, d, device="cuda", dtype=dtype)
            out = paged_decode(q, kc, vc, tables, lens, d ** -0.5, bs)
            ref = paged_decode_reference(q, kc, vc, tables, lens, d ** -0.5, bs)
            k = kc.view(-1, bs, kv, d)[tables.long()].view(b, nblk * bs, kv, d).transpose(1, 2).float()
            v = vc.view(-1, bs, kv, d)[tables.long()].view(b, nblk * bs, kv, d).transpose(1, 2).float()
            mask = (torch.arange(nblk * bs, device="cuda")[None] < lens[:, None])[:, None, None, :]
            sdpa = F.scaled_dot_product_attention(q.float().view(b, kv, h // kv, d), k, v, attn_mask=mask,
                                                  scale=d ** -0.5).reshape(b, h, d)
            err = max((out.float() - ref.float()).abs().max().item(), (out.float() - sdpa).abs().max().item())
            print(f"  {dtype} b={b} h={h} kv={kv} d={d} bs={bs} blocks={nblk}: max |kernel - ref/sdpa| {err:.2e}")
            assert err < tol, err
            worst = max(worst, err) if dtype == torch.float32 else worst
    G.result("2a paged decode kernel == reference", True, f"fp32 max diff {worst:.1e}")
except Exception:
    traceback.print_exc()
    G.result("2a paged decode kernel == reference", False, "exception")

try:
    from vllm_neuron.worker.cuda_graphs import CudaGraphCapturer, ReplayedGraph

    state = torch.zeros(4, device="cuda")

    def step(x, w, st):
        st.add_(x.sum())  # an in-place update of a persistent tensor, as the KV cache and slot state
        return torch.relu(x @ w) + st[0], st.clone()

    w = torch.randn(16, 16, device="cuda")
    g = ReplayedGraph(step, CudaGraphCapturer(), "check")
    ref_state = torch.zeros(4, device="cuda")
    ok = True
    for i in range(5):
        x = torch.randn(8, 16, device="cuda")
        got, got_state = g(x, w, state)
        want, want_state = step(x, w, ref_state)
        ok &= torch.allclose(got, want, atol=1e-5) and torch.allclose(got_state, want_state)
    G.result("2b CUDA graph replay == direct calls", bool(ok) and g.replays == 4, f"{g.replays} replays")
except Exception:
    traceback.print_exc()
    G.result("2b CUDA graph replay == direct calls", False, "exception")
sys.stdout.flush()
os._exit(0)
