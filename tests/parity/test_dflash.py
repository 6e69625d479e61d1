"""DFlash speculative decoding end to end (tiny random Llama target + tiny random DFlash draft in z-lab's /
vLLM's checkpoint layout, fp32, MRv1).

* The drafts that come out of the bucket graphs are exactly what the DFlash draft computes: a dense
  reference (transformers' hidden states of the tapped layers, fc + hidden_norm projected into each draft
  layer's K/V, one non-causal forward over [bonus, mask x K], the target's lm_head) gives the same tokens.
* Greedy output is token-identical with DFlash on and off across batch buckets, segmented prefill and
  prefix caching (kernel attention path) and preemption (torch attention path); the spec-decode counters
  move. A random draft accepts little: the low-acceptance end.
* The high-acceptance end: a constructed target / draft pair whose drafts are always right is accepted in
  full (acceptance 1.0 measured) with the output unchanged.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_factory import (build_tiny_llama, generate_token_ids, make_tiny_dflash, make_tiny_llama, shared_prefix_prompts, tiny_llm)
from vllm_neuron import LLM, SamplingParams

pytestmark = pytest.mark.engine

K = 3
TAPS = [0, 1]  # the 2-layer target's layer outputs (the last one: before the final norm)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("dflash")
    return (make_tiny_llama(str(root / "target"), max_position_embeddings=256),
            make_tiny_dflash(str(root / "draft"), target_layer_ids=TAPS, block_size=K + 1))


BUCKETS = {"neuron_config": {"num_seqs_buckets": [2, 4, 8]}}


def _engine(dirs, monkeypatch, spec=True, **kw) -> LLM:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    sc = {"method": "dflash", "model": dirs[1], "num_speculative_tokens": K} if spec else None
    return tiny_llm(dirs[0], speculative_config=sc, **{"additional_config": BUCKETS, **kw})


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
    assert core.runner.kernels.attention == kernels and core.runner.speculator.draft is not None
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


def _agreeing_pair(root) -> tuple[str, str, torch.nn.Module]:
    """A target that continues any alternation a, f(a), a, ... (f(t) = t XOR 1) and a DFlash draft that
    drafts that same alternation: (target dir, draft dir, the target's transformers model).

    Target: every layer's o_proj / down_proj is zero, so every layer's output is the token's embedding and
    logits = lm_head(norm(embed(t))). Embedding: dim 0 is a constant 1 (a "content" flag) for every real
    token, dim 1 is 0, the rest a fixed-norm random vector; the mask token (vocab - 1) is e_1. lm_head row v
    is embed[f(v)] (zero for the mask token and its partner), so greedy output is f(last token).
    Draft (one layer, one head of head_dim = hidden): fc takes the first tap (= the embedding), v_proj and
    o_proj are the identity, the MLP is zero. q_proj reads the mask flag (dim 1) and k_proj the content flag
    (dim 0), both into head dim 1, whose RoPE pair turns exactly pi per position (rope_theta = pi^(-h/2)):
    a mask row's score is +large for keys at odd distance, -large at even distance, 0 for the other mask
    rows (their key is zero). Block row j (position n + j) thus reads the embedding of the token of the
    other parity, and the target's lm_head turns it into f(that) = the token at n + j. Every draft is right
    while the context alternates; one row or position off gives the wrong parity, so ~0 acceptance."""
    hf = build_tiny_llama(max_position_embeddings=256)
    h, vocab = hf.config.hidden_size, hf.config.vocab_size
    mask_id = vocab - 1
    g = torch.Generator().manual_seed(11)
    rest = torch.randn(vocab, h - 2, generator=g)
    embed = torch.cat([torch.ones(vocab, 1), torch.zeros(vocab, 1),
                       rest * ((h - 2) ** 0.5 / rest.norm(dim=-1, keepdim=True))], 1)
    embed[mask_id] = torch.nn.functional.one_hot(torch.tensor(1), h).float()
    head = embed[torch.arange(vocab) ^ 1]
    head[mask_id] = head[mask_id ^ 1] = 0.0
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
        hf.model.embed_tokens.weight.copy_(embed)
        hf.lm_head.weight.copy_(head)
    target = make_tiny_llama(str(root / "target_agree"), model=hf)
    draft = make_tiny_dflash(str(root / "draft_agree"), hidden_size=h, vocab_size=vocab, target_layer_ids=TAPS,
                             num_layers=1, block_size=K + 1, mask_token_id=mask_id, num_heads=1, num_kv_heads=1)
    path = os.path.join(draft, "model.safetensors")
    w = {n: torch.zeros_like(t) for n, t in load_file(path).items()}  # the MLP stays zero
    for n in w:
        if n.endswith("norm.weight"):
            w[n].fill_(1.0)
    eye = torch.eye(h)
    w["fc.weight"][:, :h] = eye
    w["layers.0.self_attn.q_proj.weight"][1, 1] = -1.0
    w["layers.0.self_attn.k_proj.weight"][1, 0] = 1.0
    w["layers.0.self_attn.q_norm.weight"].fill_(2.0)  # scores +-16: q = -2 sqrt(h), k = sqrt(h), scale 1/sqrt(h)
    w["layers.0.self_attn.v_proj.weight"].copy_(eye)
    w["layers.0.self_attn.o_proj.weight"].copy_(eye)
    save_file(w, path, metadata={"format": "pt"})
    cfg_path = os.path.join(draft, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["rope_theta"] = float(torch.pi ** (-h / 2))  # inv_freq of pair 1 = theta^(-2/h) = pi
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return target, draft, hf


def test_agreeing_draft_is_accepted_and_output_unchanged(tmp_path, monkeypatch):
    """The high-acceptance end: a draft that is always right exercises the accept-everything path (the
    bonus after K accepted drafts, full-acceptance KV injection and positions) across batch buckets,
    segmented prefill and prefix caching. The output alternates by construction: the point is the full
    acceptance, not variety. A draft misaligned by one row or position drafts the wrong parity, so the
    acceptance bound catches it; the spied drafts are also checked against the dense reference."""
    *pair, hf = _agreeing_pair(tmp_path)
    pairs = [(100, 101), (2024, 2025), (31337, 31336), (48000, 48001), (777, 776), (5000, 5001), (5000, 5001)]
    lengths = [5, 17, 40, 70, 9, 130, 131]  # over the 32-token prefill budget; the last two share 8 blocks
    prompts = [[pr[i % 2] for i in range(n)] for pr, n in zip(pairs, lengths)]
    ref = _gen(_engine(pair, monkeypatch, spec=False), prompts)
    for p, o in zip(prompts, ref):  # the target continues the alternation
        assert o == [p[-1 - (i % 2)] for i in range(1, len(o) + 1)]
    llm = _engine(pair, monkeypatch)
    core = llm.llm_engine.core
    seen, buckets = [], set()

    def record(runner, out):
        buckets.add(out.bucket_name)
        seen.extend((list(runner.sampling.all_tokens(r)), d) for r, d in out.spec_token_ids.items())
    _spy(llm, record)
    assert _gen(llm, prompts) == ref
    st = core.scheduler.spec_stats
    assert st.num_drafts > 30 and st.acceptance_rate > 0.95, (st.num_drafts, st.acceptance_rate)
    assert st.mean_accepted_length > K + 0.5 and core.scheduler.spec_policy.num_pauses == 0
    assert core.scheduler.kv.prefix_hits > 0 and len({b for b in buckets if b.startswith("verify_b")}) >= 2, buckets
    for known, drafts in seen[::max(1, len(seen) // 4)]:
        assert drafts == [known[-1 - (j % 2)] for j in range(1, K + 1)] == _reference_drafts(hf, pair[1], known, K)
