"""Pipeline parallelism end to end: greedy fp32 tokens with the layers split into stages (PP=2, processes over
gloo, one thread each) equal transformers' and PP=1's on tiny Llama (3 layers: stages of 2 and 1) and Qwen3 with
tied embeddings at PP=2 x TP=2, eager, with prompts longer than max_num_batched_tokens (segmented prefill), decode
steps whole (PP=2) and in two micro-batches (PP=2 x TP=2), and (PP=2) a second pass from the prefix cache; seeded random sampling, logprobs,
prompt logprobs and a repetition penalty (host sampling) equal PP=1's; one compiled PP=2 run (one graph per
stage and kind, each stage its own compile-cache key)."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_model, make_tiny_model, shared_prefix_prompts
from vllm_neuron import LLM, SamplingParams
from vllm_neuron.model.pipeline_stage import AbsentLayer

pytestmark = pytest.mark.engine

MAX_NEW = 8
LENGTHS = [3, 17, 40, 70]  # 40 and 70 exceed max_num_batched_tokens (32): segmented prefill
SHARED = 32  # prompts 2.. share two blocks: the second pass starts from cached blocks
EAGER_BUCKETS = {"num_batched_tokens_buckets": [8, 32], "num_seqs_buckets": [1, 4]}
COMPILED_BUCKETS = {"num_batched_tokens_buckets": [32], "num_seqs_buckets": [4]}
MODELS = {"llama": dict(num_hidden_layers=3), "qwen3": dict(num_hidden_layers=2, tie_word_embeddings=True)}


def _prompts() -> list[list[int]]:
    return shared_prefix_prompts(LENGTHS, SHARED, first_shared=2, seed=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """Each model's folder and transformers' greedy tokens, one prompt at a time."""
    out = {}
    for arch, kw in MODELS.items():
        hf = build_tiny_model(arch, max_position_embeddings=512, **kw)
        with torch.no_grad():
            ref = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                               pad_token_id=2)[0, len(p):].tolist() for p in _prompts()]
        out[arch] = (make_tiny_model(str(tmp_path_factory.mktemp(f"pp_{arch}")), arch, model=hf), ref)
    return out


def _sampled(llm) -> list:
    """Host-side sampling on the logits the last stage shares: seeded random tokens with logprobs and prompt
    logprobs (a segmented prompt), a repetition penalty with top-p."""
    outs = llm.generate([{"prompt_token_ids": _prompts()[2]}, {"prompt_token_ids": _prompts()[0]}],
                        [SamplingParams(max_tokens=4, prompt_logprobs=2, logprobs=3, temperature=0.8, seed=3),
                         SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=4, repetition_penalty=1.3)],
                        use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(d) for d in (o.prompt_logprobs or [])[1:]],
             [round(max(v.logprob for v in d.values()), 4) for d in (o.outputs[0].logprobs or [])]) for o in outs]


def _generate(model_dir: str, *, pp: int, tp: int = 1, eager: bool = True, cached_pass: bool = True,
              inspect=None, extra: list | None = None, **kw) -> tuple[list[list[int]], list[list[int]], list[int]]:
    llm = LLM(model_dir, pipeline_parallel_size=pp, tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, block_size=16, dtype="float32", device="cpu", num_gpu_blocks_override=64,
              enforce_eager=eager, additional_config={"neuron_config": EAGER_BUCKETS if eager else COMPILED_BUCKETS},
              **kw)
    try:
        if inspect is not None:
            inspect(llm.llm_engine.core.runner)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False) if cached_pass else []
        if extra is not None:
            extra.append(_sampled(llm))
    finally:
        llm.llm_engine.shutdown()
    return ([o.outputs[0].token_ids for o in first], [o.outputs[0].token_ids for o in second],
            [o.num_cached_tokens for o in second])


def _check(ref, first, second, cached) -> None:
    assert first == ref, "diverged from transformers"
    assert second == ref, "the prefix-cached pass diverged from transformers"
    assert all(c >= SHARED for c in cached[2:]), f"the second pass should hit the prefix cache: {cached}"


def test_pp2_eager_equals_transformers_and_pp1(models):
    model_dir, ref = models["llama"]
    seen = {}

    def inspect(executor):
        """Rank 0 is stage 0 of 2: it built and holds the KV of layers 0 and 1 only, and no LM head."""
        runner = executor.runner
        seen["absent"] = [isinstance(layer, AbsentLayer) for layer in runner.model.model.layers]
        seen["kv_layers"] = len(runner.kv_caches)
        seen["lm_head"] = runner.model.lm_head

    sampled = []
    _check(ref, *_generate(model_dir, pp=2, inspect=inspect, extra=sampled))
    assert seen == {"absent": [False, False, True], "kv_layers": 2, "lm_head": None}
    assert _generate(model_dir, pp=1, cached_pass=False, extra=sampled)[0] == ref
    assert sampled[0] == sampled[1], "host sampling, logprobs or prompt logprobs differ between PP=2 and PP=1"
    assert len(sampled[0][0][1]) == len(_prompts()[2]) - 1  # every prompt position's logprobs came back


def test_pp2_tp2_qwen3_tied_equals_transformers(models, monkeypatch):
    """Four ranks: two stages of two tensor-parallel ranks each; the last stage's LM head is its (vocab-split)
    copy of the tied embedding; decode steps of 4 rows cross the stages in two micro-batches; async scheduling
    (the engine asks rank 0 for its stats while a step is in flight: no second broadcast may interleave)."""
    monkeypatch.setenv("VLLM_NEURON_PP_MICRO_BATCHES", "2")
    model_dir, ref = models["qwen3"]
    assert _generate(model_dir, pp=2, tp=2, cached_pass=False, async_scheduling=True)[0] == ref


@pytest.mark.slow
def test_pp2_compiled_equals_transformers(models, tmp_path, monkeypatch):
    """Compiled bucket graphs with the stage hand-offs inside (MRv2), decode in two micro-batches; each stage its
    own compile-cache key."""
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_NEURON_PP_MICRO_BATCHES", "2")
    model_dir, ref = models["llama"]
    first, _, _ = _generate(model_dir, pp=2, eager=False, cached_pass=False)
    assert first == ref
    keys = [p for p in (tmp_path / "cache").iterdir() if (p / "key.json").is_file()]
    assert len(keys) == 2, f"one compile-cache key per stage expected, got {keys}"
