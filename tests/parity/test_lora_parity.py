"""LoRA adapters against transformers + PEFT on the tiny random Llama (fp32, greedy): one batch mixing three
adapters (different ranks, rsLoRA, one on q/v only) and the base model, each request's tokens equal to
transformers with its adapter merged (merge_and_unload; PEFT's unmerged forward checked to agree); on MRv1
eager, one compiled engine (MRv2, the default runner) and TP=2; four adapters rotating through two slots
(with n-gram speculative decoding); the prefix cache never sharing a prompt's blocks between adapters; bad
adapters refused while the engine keeps serving; Mistral's sliding-window layers taking adapters too."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.model_factory import (build_tiny_llama, build_tiny_model, cached_greedy_reference, make_peft_adapter,
                                 make_tiny_model, merged_lora_model, tiny_llm)
from vllm_neuron import SamplingParams
from vllm_neuron.lora.request import LoRARequest
from vllm_neuron.worker.lora.state import LoRAState
from vllm_neuron.worker.model_runner_v2 import ModelRunnerV2

pytestmark = pytest.mark.engine

MAX_NEW = 6
LENGTHS = [5, 21, 34, 12]
# (name, rank, alpha, rsLoRA, targets)
ADAPTERS = [("a", 8, 16.0, False, None), ("b", 16, 8.0, True, None), ("c", 4, 8.0, False, ("q_proj", "v_proj")),
            ("d", 2, 4.0, False, ("o_proj", "down_proj", "up_proj"))]
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, enable_lora=True, max_lora_rank=16)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    """(base model dir, {name: LoRARequest}, {name or None: reference tokens per prompt})."""
    hf = build_tiny_llama()
    prompts = _prompts()
    loras, refs = {}, {None: cached_greedy_reference(hf, prompts, MAX_NEW)}
    for i, (name, r, alpha, rs, targets) in enumerate(ADAPTERS, 1):
        kw = {"targets": targets} if targets else {}
        path = make_peft_adapter(str(tmp_path_factory.mktemp(f"lora_{name}")), hf, r=r, lora_alpha=alpha, seed=i,
                                 use_rslora=rs, **kw)
        loras[name] = LoRARequest(name, i, path)
        refs[name] = cached_greedy_reference(merged_lora_model(hf, path), prompts, MAX_NEW)
        if name == "b":  # PEFT's own unmerged forward agrees (checked on one adapter: it is slow)
            assert cached_greedy_reference(merged_lora_model(hf, path, merge=False), prompts, MAX_NEW) == refs[name]
        assert refs[name] != refs[None], f"adapter {name} changes nothing: the test would not see it ignored"
    return tiny_llama_dir, loras, refs


def _run(llm, loras: dict, names: list) -> list[list[int]]:
    """Prompt i under adapter names[i] (None: base), all submitted together."""
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False,
                        lora_request=[loras[n] if n else None for n in names])
    return [list(o.outputs[0].token_ids) for o in outs]


def _check(llm, setup, names: list) -> None:
    _, loras, refs = setup
    got = _run(llm, loras, names)
    for i, (g, n) in enumerate(zip(got, names)):
        assert g == refs[n][i], f"prompt {i} under adapter {n} diverged from transformers"


MIXED = ["a", None, "b", "c"]  # three adapters and the base model in one batch


def test_mixed_batch_eager_mrv1(setup, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    llm = tiny_llm(setup[0], **ENGINE, max_loras=3)
    _check(llm, setup, MIXED)
    _check(llm, setup, ["c", "b", None, "a"])  # the same adapters in other slots' rows


def test_mixed_batch_compiled_mrv2(setup, monkeypatch):
    """The default runner for a compiled dense model (MRv2): the slots are read inside the compiled graphs, and
    adapters written into slots after warm-up are seen without tracing again."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    llm = tiny_llm(setup[0], **ENGINE, max_loras=3, enforce_eager=False, additional_config={"neuron_config": {
        "num_batched_tokens_buckets": [64], "num_seqs_buckets": [8]}})
    assert isinstance(llm.llm_engine.core.runner, ModelRunnerV2)
    _check(llm, setup, MIXED)
    _check(llm, setup, ["c", "b", None, "a"])


def test_rotation_through_two_slots_with_ngram(setup, monkeypatch):
    """Four adapters, two slots: the scheduler runs at most two distinct adapters at once, evicted slots are
    rewritten in place, and n-gram verification rows take their sequence's adapter."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    llm = tiny_llm(setup[0], **ENGINE, max_loras=2, max_cpu_loras=3, async_scheduling=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    state = next(k for k in llm.llm_engine.core.runner.kinds if isinstance(k, LoRAState))
    _check(llm, setup, ["a", "b", "c", "d"])
    _check(llm, setup, ["d", "c", "b", "a"])
    assert state.slot_writes >= 6  # four adapters through two slots, twice over
    assert state.host.loads > 4  # three host copies for four adapters: one was read again


def test_prefix_cache_keyed_by_adapter_and_bad_requests(setup, tmp_path):
    """The same prompt under the base model, then two adapters: no adapter reuses another's blocks (their K/V
    differ), and the same adapter again does. Bad adapters are refused before the engine and it keeps serving."""
    _, loras, refs = setup
    llm = tiny_llm(setup[0], **ENGINE, max_loras=2)
    prompt = {"prompt_token_ids": _prompts()[2]}  # 34 tokens: two full blocks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    runs = []
    for lr in (None, loras["a"], loras["b"], loras["a"]):
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lr)[0]
        runs.append((list(out.outputs[0].token_ids), out.num_cached_tokens))
    assert [r[0] for r in runs] == [refs[None][2], refs["a"][2], refs["b"][2], refs["a"][2]]
    assert [r[1] for r in runs] == [0, 0, 0, 32]

    big = tmp_path / "big"
    big.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        text = (Path(loras["a"].lora_path) / f).read_bytes()
        (big / f).write_bytes(text.replace(b'"r": 8', b'"r": 32') if f.endswith(".json") else text)
    with pytest.raises(ValueError, match="rank r=32 is above max_lora_rank=16"):
        llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("big", 9, str(big)))
    with pytest.raises(ValueError, match="not an existing folder"):
        llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("x", 10, str(tmp_path / "none")))
    _check(llm, setup, ["a", None, "c", "a"])  # the engine still serves


def test_tp2_mixed_batch(setup):
    """Tensor parallelism: each rank holds its piece of every adapter (B rows of q/k/v and gate/up, A columns of
    o and down), the delta of the row-parallel layers summed by their all-reduce."""
    llm = tiny_llm(setup[0], **ENGINE, max_loras=3, tensor_parallel_size=2)
    try:
        _check(llm, setup, MIXED)
    finally:
        llm.llm_engine.shutdown()



def test_mistral_sliding_window_layers_take_adapters(tmp_path):
    """Mistral v0.1's sliding-window layers run in a compile region of their own: an adapter reaches them too
    (prompts longer than the tiny config's window of 24)."""
    hf = build_tiny_model("mistral")
    model_dir = make_tiny_model(str(tmp_path / "mistral"), "mistral")
    path = make_peft_adapter(str(tmp_path / "lora"), hf, r=8, lora_alpha=16.0, seed=5)
    prompts = _prompts()
    want = cached_greedy_reference(merged_lora_model(hf, path), prompts, MAX_NEW)
    base = cached_greedy_reference(hf, prompts, MAX_NEW)
    assert want != base
    llm = tiny_llm(model_dir, **ENGINE, max_loras=1)
    lora = LoRARequest("m", 1, path)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False,
                        lora_request=[lora, None, lora, None])
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == [want[0], base[1], want[2], base[3]]
