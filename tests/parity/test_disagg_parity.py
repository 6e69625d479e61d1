"""Disaggregated prefill/decode, offline (two engines in this process, the TCP connector between them, and NIXL's
when the optional nixl package is installed): greedy fp32 tokens of a prompt prefilled on one instance and decoded
on another equal transformers' on tiny Llama and Qwen3 models, eager and compiled, with prompts over several blocks and past max_num_batched_tokens (TP=1 -> TP=2
runs between servers: tests/integration/test_disagg_server.py, as two engines of different TP cannot share a
process); FP8 KV through the connector equals FP8 KV locally; a decode-side prefix hit reads fewer blocks; a forged
secret gets a NIXL reader nothing and it prefills locally; every instance's KV pool back to its baseline (the prefill
instance frees what the reader released)."""
from __future__ import annotations

import time

import pytest

from tests.integration.server_utils import free_port
from tests.model_factory import build_tiny_model, greedy_reference, make_tiny_model, shared_prefix_prompts, tiny_llm
from vllm_neuron import SamplingParams
from vllm_neuron.config.kv_transfer import nixl_installed

pytestmark = pytest.mark.engine

MAX_NEW = 8
PROMPTS = shared_prefix_prompts([20, 45, 70], 32, first_shared=1, seed=5)  # 70 > max_num_batched_tokens (32)
NIXL = pytest.param("NixlConnector", marks=pytest.mark.skipif(
    not nixl_installed(), reason="the optional nixl package is not installed (pip install nixl)"))
COMPILED = {"neuron_config": {"num_batched_tokens_buckets": [32], "num_seqs_buckets": [8]}}


@pytest.fixture(autouse=True)
def _shut_down_engines(monkeypatch):
    """Each test's engines are shut down after it: their KV connectors' threads and NIXL agents would otherwise
    live on in this process for the rest of the suite (a NIXL agent's UCX context is not free when idle)."""
    made, make = [], tiny_llm

    def tracked(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]
    monkeypatch.setitem(globals(), "tiny_llm", tracked)
    yield
    for llm in made:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {a: make_tiny_model(str(tmp_path_factory.mktemp(f"disagg_{a}")), a, max_position_embeddings=256)
            for a in ("llama", "qwen3")}


def _kv(role: str, connector: str = "TcpConnector", **extra) -> dict:
    return {"kv_connector": connector, "kv_role": role, "kv_port": free_port(), **extra}


def _disaggregated(prefill, decode, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """Each prompt prefilled on `prefill` (one token, KV held), then decoded on `decode` from the held KV; the
    decode requests all at once (one batch)."""
    held = prefill.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {
                                "do_remote_decode": True, "do_remote_prefill": False}}), use_tqdm=False)
    params = [o.kv_transfer_params for o in held]
    assert all(p and p["do_remote_prefill"] for p in params)
    outs = decode.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True,
                                           extra_args={"kv_transfer_params": kp}) for kp in params], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_pools_back(*llms) -> None:
    """Every engine's KV pool whole again: the prefill instance frees what its reader released."""
    for llm in llms:
        core = llm.llm_engine.core
        deadline = time.monotonic() + 10
        while core.scheduler.kv_transfer.held and time.monotonic() < deadline:
            core.kv_transfer_tick()
            time.sleep(0.02)
        assert not core.scheduler.kv_transfer.held
        assert core.scheduler.kv.num_free_blocks() == core.num_blocks - 1


@pytest.mark.parametrize("connector", ["TcpConnector", NIXL])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_disaggregated_greedy_equals_transformers(model_dirs, arch, connector):
    ref = greedy_reference(build_tiny_model(arch, max_position_embeddings=256), PROMPTS, MAX_NEW)
    p = tiny_llm(model_dirs[arch], kv_transfer_config=_kv("kv_producer", connector))
    d = tiny_llm(model_dirs[arch], kv_transfer_config=_kv("kv_consumer", connector))
    assert _disaggregated(p, d, PROMPTS) == ref
    stats = d.llm_engine.core.scheduler.kv_transfer.stats
    assert stats.loads == 3 and stats.recomputed == 0
    assert stats.loaded_blocks == sum(-(-(len(q) - 1) // 16) for q in PROMPTS)
    # A second pass: the decode instance's own prefix cache now holds the prompts' full blocks; it reads only
    # the rest (here: nothing for the shared-prefix ones but their last partial block).
    before = stats.loaded_blocks
    assert _disaggregated(p, d, PROMPTS) == ref
    assert stats.loaded_blocks - before < before
    _assert_pools_back(p, d)


@pytest.mark.skipif(not nixl_installed(), reason="the optional nixl package is not installed (pip install nixl)")
def test_nixl_reader_with_a_forged_secret_gets_nothing_and_prefills_locally(model_dirs):
    ref = greedy_reference(build_tiny_model("llama", max_position_embeddings=256), [PROMPTS[2]], MAX_NEW)
    p = tiny_llm(model_dirs["llama"], kv_transfer_config=_kv("kv_producer", "NixlConnector"))
    d = tiny_llm(model_dirs["llama"], kv_transfer_config=_kv("kv_consumer", "NixlConnector"))
    held = p.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)[0].kv_transfer_params

    def decode(params: dict) -> list[int]:
        return d.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(
            max_tokens=MAX_NEW, temperature=0, ignore_eos=True, extra_args={"kv_transfer_params": params}),
            use_tqdm=False)[0].outputs[0].token_ids

    stats = d.llm_engine.core.scheduler.kv_transfer.stats
    assert decode({**held, "remote_secret": "0" * 32}) == ref[0]
    assert (stats.loads, stats.recomputed) == (0, 1)
    assert d.llm_engine.core.runner.kv_connector.nixl.remote_agents == {}  # not even the source's NIXL metadata
    assert decode(held) == ref[0]  # the hold outlived the forgery: its true reader still reads it
    assert (stats.loads, stats.recomputed) == (1, 1)
    _assert_pools_back(p, d)


def test_compiled_instances(model_dirs):
    ref = greedy_reference(build_tiny_model("llama", max_position_embeddings=256), PROMPTS, MAX_NEW)
    p = tiny_llm(model_dirs["llama"], enforce_eager=False, additional_config=COMPILED,
                 kv_transfer_config=_kv("kv_producer"))
    # A decode instance sees contexts far shorter than max_model_len: a 128-token context bucket (the seeds'
    # decode_context_length_buckets advice for disaggregated decode) serves them with smaller decode graphs.
    d = tiny_llm(model_dirs["llama"], enforce_eager=False, kv_transfer_config=_kv("kv_consumer"), additional_config={
        "neuron_config": {**COMPILED["neuron_config"], "decode_context_length_buckets": [128]}})
    assert _disaggregated(p, d, PROMPTS) == ref
    assert "decode_b8_c128" in {r.name for r in d.llm_engine.core.compiler.records}
    _assert_pools_back(p, d)


def test_fp8_kv_through_the_connector_equals_fp8_kv_locally(model_dirs):
    local = tiny_llm(model_dirs["llama"], kv_cache_dtype="fp8")
    want = [o.outputs[0].token_ids for o in local.generate(
        [{"prompt_token_ids": q} for q in PROMPTS], SamplingParams(max_tokens=MAX_NEW, temperature=0,
                                                                   ignore_eos=True), use_tqdm=False)]
    p = tiny_llm(model_dirs["llama"], kv_cache_dtype="fp8", kv_transfer_config=_kv("kv_producer"))
    d = tiny_llm(model_dirs["llama"], kv_cache_dtype="fp8", kv_transfer_config=_kv("kv_consumer"))
    assert _disaggregated(p, d, PROMPTS) == want
    assert d.llm_engine.core.scheduler.kv_transfer.stats.loads == 3


def test_unread_blocks_are_freed_after_the_hold_timeout(model_dirs):
    p = tiny_llm(model_dirs["llama"], kv_transfer_config=_kv("kv_producer",
                                                               kv_connector_extra_config={"hold_timeout_s": 0.5}))
    core = p.llm_engine.core
    p.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)
    assert core.scheduler.kv_transfer.stats.held_blocks == 5
    assert core.scheduler.kv.num_free_blocks() == core.num_blocks - 1 - 5
    time.sleep(0.6)
    core.kv_transfer_tick()
    assert core.scheduler.kv_transfer.stats.expired == 1 and not core.scheduler.kv_transfer.held
    assert core.scheduler.kv.num_free_blocks() == core.num_blocks - 1
    # A reader that comes now is refused, and prefills locally: the answer is the same.
    d = tiny_llm(model_dirs["llama"], kv_transfer_config=_kv("kv_consumer"))
    ref = greedy_reference(build_tiny_model("llama", max_position_embeddings=256), [PROMPTS[2]], MAX_NEW)
    late = p.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)[0].kv_transfer_params
    time.sleep(0.6)
    core.kv_transfer_tick()  # expired before the reader comes
    out = d.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(
        max_tokens=MAX_NEW, temperature=0, ignore_eos=True, extra_args={"kv_transfer_params": late}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0]
    assert d.llm_engine.core.scheduler.kv_transfer.stats.recomputed == 1


def test_requests_without_a_disaggregated_engine_are_refused(model_dirs):
    llm = tiny_llm(model_dirs["llama"])
    with pytest.raises(ValueError, match="kv_transfer_params needs an engine started with kv_transfer_config"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1, extra_args={
            "kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)
