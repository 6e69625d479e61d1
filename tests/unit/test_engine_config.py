"""EngineConfig and the CLI flags: vLLM names, defaults, and refusals of what we cannot honour."""
from __future__ import annotations

import argparse

import pytest

from vllm_neuron.config.arg_utils import add_engine_args, engine_config_from_args
from vllm_neuron.config.engine_config import EngineConfig


def _cli(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def test_unknown_kwarg_names_the_valid_ones():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.from_kwargs(max_num_seq=4)


@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel_size": 3, "nnodes": 2}, "nnodes must be a positive integer that divides"),
    ({"kv_cache_dtype": "fp8_inc"}, r"kv_cache_dtype='fp8_inc' is not supported; valid values: \['auto', 'fp8', "),
    ({"kv_cache_dtype": "fp8", "additional_config": {"neuron_config": {"fp8_packed_kv": True}}},
     "fp8_packed_kv=True is not supported yet.*Model Runner V1.*kv_cache_dtype='fp8'"),
    ({"enable_prompt_embeds": True}, "enable_prompt_embeds"),
    ({"speculative_config": {"method": "eagle3"}}, "speculative_config"),
    ({"async_scheduling": "yes"}, "async_scheduling"),
    ({"block_size": 24}, "block_size=24 is not valid"),
    ({"device": "tpu"}, "device='tpu' is not valid"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"additional_config": {"neuron_config": {"bogus": 1}}}, "bogus"),
    ({"additional_config": '{"neuron_config": '}, "additional-config"),
])
def test_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_defaults_follow_bucket_lists_when_maxima_are_not_given():
    c = EngineConfig.from_kwargs(block_size=128, max_model_len=4096, additional_config={"neuron_config": {
        "num_seqs_buckets": [1, 2, 4, 8], "kv_segment_size_buckets": [2048], "num_batched_tokens_buckets": [2048],
        "on_device_sampling_config": {"all_greedy": True}}})
    nc = c.finalize(model_max_len=8192)
    assert (c.max_num_seqs, c.max_num_batched_tokens) == (8, 2048)
    assert nc.num_seqs_buckets == [1, 2, 4, 8] and nc.context_buckets == [4096]


def test_plain_defaults():
    c = EngineConfig.from_kwargs(device="cpu")
    nc = c.finalize(model_max_len=1024)
    assert (c.max_model_len, c.max_num_seqs, c.max_num_batched_tokens) == (1024, 16, 512)
    # On CPU the default decode buckets grow by 4 (padding is cheap, graphs are not) and prefill buckets
    # start at 32 instead of the seeds' 128 (a prefill step is compute-bound: padding costs in full).
    assert nc.num_batched_tokens_buckets == [32, 64, 128, 256, 512] and nc.num_seqs_buckets == [1, 4, 16]
    assert nc.context_buckets == [1024]


def test_model_limits():
    with pytest.raises(ValueError, match="larger than the model's maximum context"):
        EngineConfig.from_kwargs(max_model_len=4096).finalize(model_max_len=2048)
    with pytest.raises(ValueError, match="multiple of block_size"):
        EngineConfig.from_kwargs(max_model_len=1000).finalize(model_max_len=2048)
    with pytest.raises(ValueError, match="must equal max_num_batched_tokens"):
        EngineConfig.from_kwargs(max_num_batched_tokens=256, additional_config={
            "neuron_config": {"num_batched_tokens_buckets": [128]}}).finalize(model_max_len=2048)


def test_cli_flags_map_to_fields():
    c = _cli("/m", "--max-model-len", "1024", "--max-num-seqs", "4", "--no-enable-prefix-caching",
             "--enforce-eager", "--block-size", "16", "--num-gpu-blocks-override", "99", "--dtype", "float32",
             "--additional-config", '{"neuron_config": {"num_seqs_buckets": [2, 4]}}')
    assert (c.model, c.max_model_len, c.max_num_seqs, c.enable_prefix_caching, c.enforce_eager) == \
        ("/m", 1024, 4, False, True)
    assert (c.block_size, c.num_gpu_blocks_override, c.dtype) == (16, 99, "float32")
    assert c.neuron_config.num_seqs_buckets == [2, 4]


def test_cli_refuses_vllm_quantization_flag_and_conflicting_models():
    with pytest.raises(ValueError, match="--quantization"):
        _cli("--quantization", "neuron_quant")
    with pytest.raises(ValueError, match="conflicting models"):
        _cli("/a", "--model", "/b")


def test_async_scheduling_default_and_on_device_sampling(monkeypatch):
    import torch

    # CPU with torch on every core: the host is the device, so the default is off (explicit on is honoured).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    c = EngineConfig.from_kwargs(max_model_len=256, device="cpu")
    c.finalize(model_max_len=2048)
    assert c.async_scheduling is False and "--async-scheduling" in c.async_scheduling_reason
    on = EngineConfig.from_kwargs(max_model_len=256, device="cpu", async_scheduling=True)
    on.finalize(model_max_len=2048)
    assert on.async_scheduling is True
    # Spare cores for host work: on by default.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    spare = EngineConfig.from_kwargs(max_model_len=256, device="cpu")
    spare.finalize(model_max_len=2048)
    assert spare.async_scheduling is True
    off = EngineConfig.from_kwargs(max_model_len=256, async_scheduling=False)
    off.finalize(model_max_len=2048)
    assert off.async_scheduling is False
    cpu = EngineConfig.from_kwargs(max_model_len=256, additional_config={"neuron_config": {
        "on_device_sampling_config": None}})
    cpu.finalize(model_max_len=2048)
    assert cpu.async_scheduling is False  # CPU sampling: the default turns async off
    forced = EngineConfig.from_kwargs(max_model_len=256, async_scheduling=True, additional_config={
        "neuron_config": {"on_device_sampling_config": None}})
    with pytest.raises(ValueError, match="async_scheduling=True requires on-device sampling"):
        forced.finalize(model_max_len=2048)


def test_no_async_scheduling_flag():
    c = _cli("--no-async-scheduling")
    assert c.async_scheduling is False


@pytest.mark.parametrize("flag, option", [
    (["--mm-encoder-only"], "mm_encoder_only"),
    (["--ec-transfer-config", '{"ec_role": "ec_producer"}'], "ec_transfer_config"),
])
def test_epd_flags_parse_and_are_refused(flag, option):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(flag)  # not argparse's "unrecognized arguments"
    with pytest.raises(ValueError, match=f"{option}=.* is not supported yet"):
        engine_config_from_args(args)


def test_multimodal_options_are_validated_and_refused_for_text_models():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args(["--limit-mm-per-prompt", '{"image": 4}',
                                                     "--mm-processor-kwargs", '{"max_pixels": 50176}']))
    assert cfg.limit_mm_per_prompt == {"image": 4} and cfg.mm_processor_kwargs == {"max_pixels": 50176}
    with pytest.raises(ValueError, match="limit_mm_per_prompt applies to multimodal models only"):
        cfg.finalize(model_max_len=2048)
    with pytest.raises(ValueError, match="unknown modality 'audio'; valid modalities: \\['image', 'video'\\]"):
        EngineConfig.from_kwargs(limit_mm_per_prompt={"audio": 1})
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        EngineConfig.from_kwargs(limit_mm_per_prompt='{"image": -1}')
    with pytest.raises(ValueError, match="not an existing folder"):
        EngineConfig.from_kwargs(allowed_local_media_path="/no/such/folder")
    text_only = EngineConfig.from_kwargs(additional_config={"mm_language_model_only": True})
    with pytest.raises(ValueError, match="mm_language_model_only applies to multimodal models only"):
        text_only.finalize(model_max_len=2048)


def test_encoder_neuron_config_needs_a_multimodal_model_and_one_device():
    text = EngineConfig.from_kwargs(additional_config={"encoder_neuron_config": {"encoder_attention_block_size": 256}})
    with pytest.raises(ValueError, match="encoder_neuron_config applies to multimodal models only"):
        text.finalize(model_max_len=2048)
    tp = EngineConfig.from_kwargs(additional_config={"encoder_neuron_config": {"tp_size": 2, "dp_size": 1}})
    with pytest.raises(ValueError, match="tp_size \\* dp_size must equal world_size"):
        tp.finalize(model_max_len=2048, multimodal=True)
    hold = EngineConfig.from_kwargs(additional_config={"encoder_neuron_config": {"encoder_cache_min_hold_time_ms": 5}})
    with pytest.raises(ValueError, match="encoder_cache_min_hold_time_ms=5.* is not supported yet"):
        hold.finalize(model_max_len=2048, multimodal=True)
    ok = EngineConfig.from_kwargs(additional_config={"encoder_neuron_config": {"encoder_attention_block_size": 256}})
    ok.finalize(model_max_len=2048, multimodal=True)
