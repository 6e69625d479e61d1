"""EAGLE3 speculative decoding end to end (tiny random Llama target + tiny random EAGLE3 draft in vLLM's
checkpoint layout, fp32, MRv1).

* The drafts that come out of the bucket graphs are exactly what the EAGLE3 head computes: a dense
  reference (transformers' hidden states of the tapped layers, fc, one decoder layer over [embedding,
  features], K - 1 autoregressive steps on its own pre-norm output, d2t) gives the same tokens.
* Greedy output is token-identical with EAGLE3 on and off across batch buckets, segmented prefill,
  prefix caching (kernel attention path) and preemption (torch attention path). A random draft accepts
  little: that is the low-acceptance end. The high end: a target and a draft built to agree (below)
  accept nearly every draft, with the same output as the target alone.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.model_factory import (build_tiny_llama, generate_token_ids, make_tiny_eagle3, make_tiny_llama, shared_prefix_prompts, tiny_llm)
from vllm_neuron import LLM, SamplingParams

pytestmark = pytest.mark.engine

K = 3
AUX = [0, 1, 1]  # the 2-layer target's taps (vLLM's default needs >= 4 layers)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("eagle3")
    return (make_tiny_llama(str(root / "target"), max_position_embeddings=256),
            make_tiny_eagle3(str(root / "draft"), aux_layer_ids=AUX))


BUCKETS = {"neuron_config": {"num_seqs_buckets": [2, 4, 8]}}


def _engine(dirs, monkeypatch, spec=True, **kw) -> LLM:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    sc = {"method": "eagle3", "model": dirs[1], "num_speculative_tokens": K} if spec else None
    return tiny_llm(dirs[0], speculative_config=sc, **{"additional_config": BUCKETS, **kw})


def _prompts() -> list[list[int]]:
    # Over the 32-token prefill budget (segmented prefill); the last four share 4 blocks (prefix hits).
    return shared_prefix_prompts([5, 17, 40, 70, 90, 130, 130, 131, 128], 128, 5, seed=3)


def _gen(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return generate_token_ids(llm, prompts, params)


@pytest.fixture(scope="module")
def reference(dirs) -> list[list[int]]:
    mp = pytest.MonkeyPatch()
    try:
        return _gen(_engine(dirs, mp, spec=False), _prompts())
    finally:
        mp.undo()


class _RefDraft:
    """Dense EAGLE3 head on the checkpoint's tensors: the reference the graphs must agree with."""

    def __init__(self, path: str, embed: torch.Tensor) -> None:
        self.w = load_file(os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json")) as f:
            self.cfg = json.load(f)
        self.embed = embed
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def _rms(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]))

    def _rope(self, x, pos):
        d = x.shape[-1]
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        f = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def step(self, ids: list[int], start: int, hidden: torch.Tensor) -> torch.Tensor:
        """Rows at positions start.. (causal over everything written before); returns pre-norm outputs."""
        w, heads, kvh = self.w, self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        n, d = len(ids), self.cfg["hidden_size"] // heads
        pos = torch.arange(start, start + n)
        x = torch.cat([self._rms(self.embed[ids], "midlayer.input_layernorm.weight"),
                       self._rms(hidden, "midlayer.hidden_norm.weight")], -1)
        q = self._rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), pos)
        k = self._rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kvh, d), pos)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kvh, d)
        for i, p in enumerate(pos.tolist()):
            self.keys[p], self.values[p] = k[i], v[i]
        out = []
        for i, p in enumerate(pos.tolist()):
            ks = torch.stack([self.keys[j] for j in range(p + 1)]).repeat_interleave(heads // kvh, 1)
            vs = torch.stack([self.values[j] for j in range(p + 1)]).repeat_interleave(heads // kvh, 1)
            att = torch.softmax(torch.einsum("hd,thd->ht", q[i], ks) / d**0.5, -1)
            out.append(torch.einsum("ht,thd->hd", att, vs).reshape(-1))
        h = hidden + torch.stack(out) @ w["midlayer.self_attn.o_proj.weight"].T
        m = self._rms(h, "midlayer.post_attention_layernorm.weight")
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        return h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    def token(self, prenorm: torch.Tensor) -> int:
        idx = int(torch.argmax(self._rms(prenorm, "norm.weight") @ self.w["lm_head.weight"].T))
        return idx + int(self.w["d2t"][idx])


@torch.no_grad()
def _reference_drafts(hf, draft_dir: str, known: list[int], k: int) -> list[int]:
    """Drafts after `known` (the newest token not yet through the target)."""
    ref = _RefDraft(draft_dir, hf.model.embed_tokens.weight)
    hs = hf(torch.tensor([known[:-1]]), output_hidden_states=True).hidden_states  # [i]: input of layer i
    feats = torch.cat([hs[i][0] for i in AUX], -1) @ ref.w["fc.weight"].T
    h = ref.step(known[1:], 0, feats)[-1:]
    out = [ref.token(h[0])]
    for j in range(1, k):
        h = ref.step([out[-1]], len(known) - 2 + j, h)
        out.append(ref.token(h[0]))
    return out


def test_graph_drafts_are_the_eagle3_heads(dirs, monkeypatch):
    """One sequence (batch bucket 1: no padding rows in the null block): after the prefill 1 draft, after
    every decode / verification step K drafts, each equal to the dense reference's."""
    llm = _engine(dirs, monkeypatch, max_num_seqs=1, additional_config={"neuron_config": {"num_seqs_buckets": [1]}})
    runner = llm.llm_engine.core.runner
    seen = []
    orig = runner.execute

    def spy(sched):
        out = orig(sched)
        seen.extend((list(runner.sampling.all_tokens(r)), d) for r, d in out.spec_token_ids.items())
        return out
    runner.execute = spy
    prompt = shared_prefix_prompts([45], 0, 1, seed=5)[0]
    _gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    hf = build_tiny_llama(max_position_embeddings=256)
    assert len(seen) >= 4 and len(seen[0][1]) == 1 and all(len(d) == K for _, d in seen[1:])
    for known, drafts in seen:
        assert drafts == _reference_drafts(hf, dirs[1], known, len(drafts)), len(known)


@pytest.mark.parametrize("kernels, blocks", [(True, 160), (False, 17)], ids=["kernels", "torch_attention_preemption"])
def test_greedy_identical_with_eagle3(dirs, reference, monkeypatch, kernels, blocks):
    """17 blocks of 16 tokens: one max_model_len request fits, the long prompts cannot all stay resident."""
    if not kernels:
        monkeypatch.setenv("VLLM_NEURON_DISABLE_NKI_KERNELS", "1")
    llm = _engine(dirs, monkeypatch, num_gpu_blocks_override=blocks)
    core = llm.llm_engine.core
    assert core.runner.kernels.attention == kernels and core.runner.speculator.draft is not None
    buckets = set()
    orig = core.runner.execute

    def spy(sched):
        out = orig(sched)
        buckets.add(out.bucket_name)
        return out
    core.runner.execute = spy
    assert _gen(llm, _prompts()) == reference
    st = core.scheduler.spec_stats
    assert st.num_drafts > 50 and st.acceptance_rate < 0.2  # a random draft: the low-acceptance end
    assert core.scheduler.kv.prefix_hits > 0
    if blocks == 17:
        assert core.scheduler.num_preemptions > 0
    else:
        assert len({b for b in buckets if b.startswith("verify_b")}) >= 2, buckets
    assert not core.has_unfinished() and core.scheduler.kv.pool.num_free_blocks == core.num_blocks - 1


@pytest.mark.slow
def test_eagle3_compiled_graphs(dirs, monkeypatch, tmp_path):
    """Compiled buckets with the draft head inside them: no extra graph (prefill, decode, verify), and the
    output equals the non-speculative one."""
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


def _agreeing_pair(root) -> tuple[str, str]:
    """A target whose next token depends on the last token only, and an EAGLE3 draft that computes the
    same function.

    Target: every layer's o_proj / down_proj is zero, so the final hidden state is the token's embedding
    and logits = lm_head(norm(embed(t))); lm_head is the embedding shifted by one row, so greedy output
    tends to count up (t + 1, t + 2, ...) and tokens rarely repeat. Draft (one head of 64 dims): fc is
    zero; attention keys and queries are the normalized embedding of the draft's input token (scaled, on
    the dims RoPE barely rotates: a huge rope_theta leaves only the first pair turning), so each row
    attends to itself; its value is that embedding minus the normalized incoming hidden state, which
    the residual adds back: the pre-norm output is the input token's normalized embedding, at the first
    step (features 0) and at every autoregressive one. The draft's norm and lm_head are the target's and
    its vocabulary is the target's (d2t all zero), so draft logits = the target's logits for that token."""
    from safetensors.torch import save_file

    hf = build_tiny_llama(max_position_embeddings=256)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
        hf.lm_head.weight.copy_(torch.roll(hf.model.embed_tokens.weight, 1, 0))
    target = make_tiny_llama(str(root / "target_agree"), model=hf)
    h, vocab = hf.config.hidden_size, hf.config.vocab_size
    eye = torch.eye(h)
    qk = eye.clone()
    qk[0, 0] = qk[h // 2, h // 2] = 0.0  # the pair RoPE turns one radian per position
    zeros = torch.zeros(h, h)
    state = {"fc.weight": torch.zeros(h, 3 * h), "norm.weight": torch.ones(h),
             "lm_head.weight": hf.lm_head.weight.detach().clone(), "d2t": torch.zeros(vocab, dtype=torch.long),
             "t2d": torch.ones(vocab, dtype=torch.bool),
             "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
             "midlayer.post_attention_layernorm.weight": torch.ones(h),
             "midlayer.self_attn.q_proj.weight": torch.cat([8.0 * qk, zeros], 1),
             "midlayer.self_attn.k_proj.weight": torch.cat([qk, zeros], 1),
             "midlayer.self_attn.v_proj.weight": torch.cat([eye, -eye], 1),
             "midlayer.self_attn.o_proj.weight": eye.clone(),
             "midlayer.mlp.gate_proj.weight": torch.zeros(16, h), "midlayer.mlp.up_proj.weight": torch.zeros(16, h),
             "midlayer.mlp.down_proj.weight": torch.zeros(h, 16)}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": 16, "num_attention_heads": 1, "num_key_value_heads": 1, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-5, "rope_theta": 1e128, "vocab_size": vocab, "draft_vocab_size": vocab,
           "target_hidden_size": h, "max_position_embeddings": 2048, "torch_dtype": "float32",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}}
    draft = root / "draft_agree"
    draft.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(draft / "model.safetensors"), metadata={"format": "pt"})
    (draft / "config.json").write_text(json.dumps(cfg))
    return target, str(draft)


def test_agreeing_draft_is_accepted_and_output_unchanged(tmp_path, monkeypatch):
    pair = _agreeing_pair(tmp_path)
    prompts = _prompts()[:4]
    ref = _gen(_engine(pair, monkeypatch, spec=False), prompts)
    assert sum(len(set(o)) for o in ref) > 0.9 * sum(len(o) for o in ref)  # the output rarely repeats a token
    llm = _engine(pair, monkeypatch)
    assert _gen(llm, prompts) == ref
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_drafts > 20 and st.acceptance_rate > 0.95, (st.num_drafts, st.acceptance_rate)
    assert st.mean_accepted_length > K + 0.5 and llm.llm_engine.core.scheduler.spec_policy.num_pauses == 0
