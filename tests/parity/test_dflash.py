"""DFlash speculative decoding end to end (tiny random Llama target + tiny random DFlash draft in z-lab's /
vLLM's checkpoint layout, fp32, MRv1).

* The drafts that come out of the bucket graphs are exactly what the DFlash draft computes: a dense
  reference (transformers' hidden states of the tapped layers, fc + hidden_norm projected into each draft
  layer's K/V, one non-causal forward over [bonus, mask x K], the target's lm_head) gives the same tokens.
* Greedy output is token-identical with DFlash on and off across batch buckets, segmented prefill and
  prefix caching (kernel attention path) and preemption (torch attention path); the spec-decode counters
  move. A random draft accepts little: the low-acceptance end.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.model_factory import generate_token_ids, build_tiny_llama, make_tiny_dflash, make_tiny_llama, shared_prefix_prompts
from vllm_neuron import LLM, SamplingParams

K = 3
TAPS = [0, 1]  # the 2-layer target's layer outputs (the last one: before the final norm)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("dflash")
    return (make_tiny_llama(str(root / "target"), max_position_embeddings=256),
            make_tiny_dflash(str(root / "draft"), target_layer_ids=TAPS, block_size=K + 1))


def _engine(dirs, monkeypatch, spec=True, **kw) -> LLM:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    base = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, block_size=16, dtype="float32",
                device="cpu", num_gpu_blocks_override=160, enforce_eager=True,
                additional_config={"neuron_config": {"num_seqs_buckets": [2, 4, 8]}})
    base.update(kw)
    sc = {"method": "dflash", "model": dirs[1], "num_speculative_tokens": K} if spec else None
    return LLM(dirs[0], speculative_config=sc, **base)


def _prompts() -> list[list[int]]:
    # Over the 32-token prefill budget (segmented prefill); the last four share 4 blocks (prefix hits).
    return shared_prefix_prompts([5, 17, 40, 70, 130, 130, 131], 128, 3, seed=3)


def _gen(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return generate_token_ids(llm, prompts, params)


@pytest.fixture(scope="module")
def reference(dirs) -> list[list[int]]:
    mp = pytest.MonkeyPatch()
    try:
        return _gen(_engine(dirs, mp, spec=False), _prompts())
    finally:
        mp.undo()


@torch.no_grad()
def _reference_drafts(hf, draft_dir: str, known: list[int], k: int) -> list[int]:
    """Dense DFlash draft: context = every token but the newest (`known[-1]`, the bonus), block = [bonus, mask x k]."""
    w = load_file(os.path.join(draft_dir, "model.safetensors"))
    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kvh, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    d = cfg["head_dim"]

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        f = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    out = hf(torch.tensor([known[:-1]]), output_hidden_states=True)
    hs = out.hidden_states  # hs[i + 1]: output of layer i (the last one after the final norm in transformers)
    n = len(known) - 1
    taps = []
    for i in cfg["dflash_config"]["target_layer_ids"]:
        if i + 1 == len(hf.model.layers):  # transformers normalizes the last entry; DFlash taps the raw output
            x = hf.model.embed_tokens(torch.tensor([known[:-1]]))
            pos_ids = torch.arange(n)[None]
            pe = hf.model.rotary_emb(x, pos_ids)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            for layer in hf.model.layers:
                x = layer(x, attention_mask=mask, position_ids=pos_ids, position_embeddings=pe)
                x = x[0] if isinstance(x, tuple) else x
            taps.append(x[0])
        else:
            taps.append(hs[i + 1][0])
    ctx = rms(torch.cat(taps, -1) @ w["fc.weight"].T, w["hidden_norm.weight"])
    embed = hf.model.embed_tokens.weight
    x = embed[[known[-1]] + [cfg["dflash_config"]["mask_token_id"]] * k]
    cpos, bpos = torch.arange(n), torch.arange(n, n + k + 1)
    for li in range(cfg["num_hidden_layers"]):
        p = f"layers.{li}."
        hln = rms(x, w[p + "input_layernorm.weight"])
        q = rope(rms((hln @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, d), w[p + "self_attn.q_norm.weight"]),
                 bpos)

        def kv(src, pos):
            kk = rms((src @ w[p + "self_attn.k_proj.weight"].T).view(-1, kvh, d), w[p + "self_attn.k_norm.weight"])
            return rope(kk, pos), (src @ w[p + "self_attn.v_proj.weight"].T).view(-1, kvh, d)
        kc, vc = kv(ctx, cpos)
        kb, vb = kv(hln, bpos)
        ks = torch.cat([kc, kb]).repeat_interleave(heads // kvh, 1)
        vs = torch.cat([vc, vb]).repeat_interleave(heads // kvh, 1)
        att = torch.softmax(torch.einsum("qhd,thd->hqt", q, ks) / d**0.5, -1)  # non-causal: every key
        x = x + torch.einsum("hqt,thd->qhd", att, vs).reshape(k + 1, -1) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    logits = hf.lm_head(rms(x, w["norm.weight"]))[1:]
    return torch.argmax(logits, -1).tolist()


def _spy(llm, fn):
    runner = llm.llm_engine.core.runner
    orig = runner.execute

    def spy(sched):
        out = orig(sched)
        fn(runner, out)
        return out
    runner.execute = spy


def test_graph_drafts_are_the_dflash_drafts(dirs, monkeypatch):
    """One sequence: after the prefill and after every decode / verification step, K drafts equal to the dense
    reference's (the newest token is the block's bonus; everything before it is injected context)."""
    llm = _engine(dirs, monkeypatch, max_num_seqs=1, additional_config={"neuron_config": {"num_seqs_buckets": [1]}})
    seen = []
    _spy(llm, lambda runner, out: seen.extend((list(runner.sampling.all_tokens(r)), d)
                                              for r, d in out.spec_token_ids.items()))
    prompt = shared_prefix_prompts([45], 0, 1, seed=5)[0]
    _gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    hf = build_tiny_llama(max_position_embeddings=256)
    assert len(seen) >= 4 and all(len(d) == K for _, d in seen)
    for known, drafts in seen:
        assert drafts == _reference_drafts(hf, dirs[1], known, K), len(known)


@pytest.mark.parametrize("kernels, blocks", [(True, 160), (False, 17)], ids=["kernels", "torch_attention_preemption"])
def test_greedy_identical_with_dflash(dirs, reference, monkeypatch, kernels, blocks):
    """17 blocks of 16 tokens: one max_model_len request fits, the long prompts cannot all stay resident."""
    if not kernels:
        monkeypatch.setenv("VLLM_NEURON_DISABLE_NKI_KERNELS", "1")
    llm = _engine(dirs, monkeypatch, num_gpu_blocks_override=blocks)
    core = llm.llm_engine.core
    assert core.runner.use_kernels == kernels and core.runner.draft is not None
    buckets = set()
    _spy(llm, lambda runner, out: buckets.add(out.bucket_name))
    assert _gen(llm, _prompts()) == reference
    st = core.scheduler.spec_stats
    assert st.num_drafts > 30 and st.num_draft_tokens > 2 * st.num_drafts  # K each, fewer near max_tokens
    assert core.scheduler.kv.prefix_hits > 0
    if blocks == 17:
        assert core.scheduler.num_preemptions > 0
    else:
        assert len({b for b in buckets if b.startswith("verify_b")}) >= 2, buckets
    assert not core.has_unfinished() and core.scheduler.kv.pool.num_free_blocks == core.num_blocks - 1


@pytest.mark.slow
def test_dflash_compiled_graphs(dirs, monkeypatch, tmp_path):
    """Compiled buckets with the draft inside them: no extra graph (prefill, decode, verify), and the output
    equals the non-speculative one."""
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    kw = dict(enforce_eager=False, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64,
              num_gpu_blocks_override=64,
              additional_config={"neuron_config": {"num_batched_tokens_buckets": [64], "num_seqs_buckets": [2]}})
    prompts = [[40, 41, 42, 43] * 6, [900, 901, 902] * 5 + [7]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = _gen(_engine(dirs, monkeypatch, spec=False, **{**kw, "enforce_eager": True}), prompts, params)
    llm = _engine(dirs, monkeypatch, **kw)
    core = llm.llm_engine.core
    assert [r.name for r in core.compiler.records] == ["prefill_s64", "decode_b2", "verify_b2_k3"]
    assert _gen(llm, prompts, params) == ref
    assert core.scheduler.spec_stats.num_drafts > 0
