"""The offline LLM API on a tiny random model: vLLM-shaped outputs and vLLM's sampling semantics."""
from __future__ import annotations

import pytest

from vllm_neuron import LLM, SamplingParams
from vllm_neuron.outputs import RequestOutput

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, enforce_eager=True, max_model_len=512, max_num_seqs=8, dtype="float32",
               num_gpu_blocks_override=256, block_size=16)


@pytest.fixture(scope="module")
def host_llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, enforce_eager=True, max_model_len=512, max_num_seqs=8, dtype="float32",
               num_gpu_blocks_override=256, block_size=16,
               additional_config={"neuron_config": {"on_device_sampling_config": None}})


def test_generate_shapes_and_prompt_forms(llm):
    outs = llm.generate(["Hello there", [1, 2, 3, 4], {"prompt": "Hi"}, {"prompt_token_ids": [5, 6, 7]}],
                        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput] * 4
    assert outs[0].prompt == "Hello there" and outs[1].prompt_token_ids == [1, 2, 3, 4]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 5
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("which", ["llm", "host_llm"])
def test_seeded_sample_is_independent_of_the_batch(which, request):
    engine = request.getfixturevalue(which)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = engine.generate(["The weather today"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = engine.generate(["Once upon", "The weather today", "1 2 3 4 5 6 7 8"], [others, seeded, others],
                            use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = engine.generate(["The weather today"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_n_choices_and_logprobs(llm):
    out = llm.generate("Count:", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                                                logprobs=3), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per choice
    for c in out.outputs:
        assert len(c.logprobs) == 6
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and len(entry) >= 3
            assert all(lp.logprob <= 0 for lp in entry.values())
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop],
                                              include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
    by_id = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                               stop_token_ids=[ids[3]]), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == ids[:ids.index(ids[3]) + 1] and by_id.stop_reason == ids[3]


def test_min_tokens_and_eos(llm):
    tok = llm.get_tokenizer()
    # Bias EOS so strongly that greedy picks it at once, unless min_tokens holds it back.
    bias = {tok.eos_token_id: 100.0}
    first = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias), use_tqdm=False)[0]
    assert first.outputs[0].token_ids == [tok.eos_token_id] and first.outputs[0].finish_reason == "stop"
    held = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=10, logit_bias=bias, min_tokens=4),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) == 5 and held.token_ids[-1] == tok.eos_token_id


def test_frequency_penalty_breaks_a_forced_repeat(llm):
    x = 1000
    bias = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={x: 12.0})
    plain = llm.generate("hello", bias, use_tqdm=False)[0].outputs[0].token_ids
    assert plain == [x] * 12  # the bias alone makes x win every step
    pen = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={x: 12.0},
                         frequency_penalty=2.0)
    toks = llm.generate("hello", pen, use_tqdm=False)[0].outputs[0].token_ids
    assert 1 <= toks.count(x) < 12  # each occurrence costs 2: x stops winning after a few


def test_bad_input_is_a_clear_error_and_engine_survives(llm):
    with pytest.raises(ValueError, match="maximum context length is 512"):
        llm.generate([1] * 500, SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(ValueError, match="cannot be empty"):
        llm.generate([[]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3, temperature=0.0),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert out.prompt_token_ids.count(tok.convert_tokens_to_ids("<|im_start|>")) >= 2  # system + user (+ assistant)


def test_config_is_resolved_once_and_engine_cores_take_it_resolved(tiny_llama_dir, monkeypatch):
    """LLM(...) resolves its options once, in its own process; the engine core gets the frozen result and
    never resolves (nor builds another EngineConfig) itself. max_logprobs=-1 (the whole vocabulary) rides along."""
    from vllm_neuron.config import engine_config
    from vllm_neuron.config.engine_args import EngineArgs
    from vllm_neuron.config.engine_config import EngineConfig
    from vllm_neuron.engine.core import EngineCore
    from vllm_neuron.engine.resolve import resolve_engine_config

    opts = dict(model=tiny_llama_dir, enforce_eager=True, max_model_len=256, max_num_seqs=2, dtype="float32",
                num_gpu_blocks_override=32, block_size=16)
    calls = []
    real = engine_config.resolve
    monkeypatch.setattr(engine_config, "resolve", lambda *a: calls.append(a) or real(*a))
    llm = LLM(**opts, max_logprobs=-1)
    assert len(calls) == 1 and llm.llm_engine.core.config is llm.llm_engine.config
    out = llm.generate("Hi", SamplingParams(max_tokens=2, logprobs=30, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 30  # above the default cap of 20

    config, ckpt = resolve_engine_config(EngineArgs.from_kwargs(**opts))

    def no_more(*args, **kwargs):
        raise AssertionError("an engine core resolved the configuration again")

    monkeypatch.setattr(engine_config, "resolve", no_more)
    monkeypatch.setattr(EngineConfig, "__init__", no_more)
    core = EngineCore(config, ckpt)
    assert core.config is config and (core.device, core.dtype) == (config.torch_device, config.torch_dtype)
    with pytest.raises(TypeError, match="EngineCore takes a resolved EngineConfig"):
        EngineCore(EngineArgs.from_kwargs(**opts))


def test_expert_parallel_on_a_dense_model_is_refused_before_the_engine_starts(tiny_llama_dir):
    with pytest.raises(ValueError, match="enable_expert_parallel=True cannot apply to this model: it has no experts"):
        LLM(tiny_llama_dir, enable_expert_parallel=True, enforce_eager=True, max_model_len=256)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_step_runs_under_the_frame_stack_room(tiny_llama_dir, async_scheduling):
    """Whichever thread runs the steps (the caller's, or the step thread with async scheduling), the runner's
    execute runs under frame_stack's room frame, where its calls never map and unmap frame memory."""
    import sys

    from vllm_neuron import frame_stack

    llm = LLM(tiny_llama_dir, enforce_eager=True, max_model_len=512, max_num_seqs=4, dtype="float32",
              num_gpu_blocks_override=64, block_size=16, async_scheduling=async_scheduling)
    runner = llm.llm_engine.core.runner
    execute, under_room = runner.execute, []

    def checked(sched):
        f = sys._getframe(1)
        while f is not None and f.f_code is not frame_stack._ROOM.__code__:
            f = f.f_back
        under_room.append(f is not None)
        return execute(sched)

    runner.execute = checked
    try:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert len(under_room) >= 4 and all(under_room), under_room


def test_freed_blocks_are_reused_before_the_pool_backs_new_memory(tiny_llama_dir, monkeypatch):
    """Many requests a few at a time: blocks freed by finished requests are handed out again before blocks whose
    KV pages were never backed, so the pool backs about what the requests hold at once, not every block they
    ever used (block_pool.py); the output is the same as with an engine that backs every block it takes."""
    monkeypatch.setenv("VLLM_NEURON_KV_PREFAULT_MB", "1")
    prompts = [[(7 * i + j) % 250 + 3 for j in range(100)] for i in range(40)]  # 7 blocks of 16 each
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(tiny_llama_dir, enforce_eager=True, max_model_len=512, max_num_seqs=4, dtype="float32",
              num_gpu_blocks_override=2048, block_size=16)
    try:
        pf = llm.llm_engine.core.runner.kv_prefaulter
        assert pf is not None and pf.chunk < 40 * 7  # in id order the requests would need several sweeps
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert pf.frontier == pf.chunk  # the first sweep backed every block the run needed
    finally:
        llm.llm_engine.shutdown()
    core = LLM(tiny_llama_dir, enforce_eager=True, max_model_len=512, max_num_seqs=4, dtype="float32",
               num_gpu_blocks_override=2048, block_size=16)
    try:
        core.llm_engine.core._backed_blocks = lambda: None  # no hint: id order the whole way
        assert [o.outputs[0].token_ids for o in core.generate(prompts, params, use_tqdm=False)] == out
        assert core.llm_engine.core.runner.kv_prefaulter.frontier > 40 * 7 * 3 // 4
    finally:
        core.llm_engine.shutdown()
