"""EngineArgs / EngineConfig and the CLI flags: vLLM names, defaults, refusals of what we cannot honour, and
the resolved config: frozen, resolved once."""
from __future__ import annotations

import argparse
import dataclasses
import json
import pickle

import pytest
import torch

from vllm_neuron.config.arg_utils import add_engine_args, engine_args_from_cli
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import EngineConfig, ModelFacts, resolve
from vllm_neuron.config import cpu_class


def _cli(*argv: str) -> EngineArgs:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_args_from_cli(p.parse_args(list(argv)))


def _resolve(model_max_len: int = 2048, **kwargs) -> EngineConfig:
    return resolve(EngineArgs.from_kwargs(**kwargs), ModelFacts(model_max_len))


def test_unknown_kwarg_names_the_valid_ones():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs.from_kwargs(max_num_seq=4)


@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel_size": 3, "nnodes": 2}, "nnodes must be a positive integer that divides"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "nnodes": 3}, "tensor_parallel_size=2 x "
     "pipeline_parallel_size=2 = 4 ranks"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "pipeline_parallel_size=2 is not supported yet by vllm-neuron with speculative decoding"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2 is not supported yet.*log-sum-exp merge"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be a positive integer"),
    ({"kv_cache_dtype": "fp8_inc"}, r"kv_cache_dtype='fp8_inc' is not valid; valid values: \['auto', 'fp8', "),
    ({"kv_cache_dtype": "fp8", "additional_config": {"neuron_config": {"fp8_packed_kv": True}}},
     "fp8_packed_kv=True is not supported yet.*Model Runner V1.*kv_cache_dtype='fp8'"),
    ({"enable_prompt_embeds": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "enable_prompt_embeds=True is not supported yet.*speculative decoding"),
    ({"speculative_config": {"method": "eagle3"}}, "speculative_config"),
    ({"async_scheduling": "yes"}, "async_scheduling"),
    ({"logprobs_mode": "logits"}, r"logprobs_mode='logits' is not valid; valid values: \['raw_logprobs'"),
    ({"logits_processors": ["no_such_module_xyz:Cls"]}, "cannot import module 'no_such_module_xyz'"),
    ({"logits_processors": ["json:nope"]}, "module 'json' has no 'nope'"),
    ({"logits_processors": ["json:dumps"]}, "'json:dumps' is not a logits processor class"),
    ({"logits_processors": "json:dumps"}, "logits_processors must be a list"),
    ({"block_size": 24}, "block_size=24 is not valid"),
    ({"scheduling_policy": "lifo"}, r"scheduling_policy='lifo' is not valid; valid values: \['fcfs', 'priority'\]"),
    ({"device": "tpu"}, "device='tpu' is not valid"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"additional_config": {"neuron_config": {"bogus": 1}}}, "bogus"),
    ({"additional_config": '{"neuron_config": '}, "additional-config"),
])
def test_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs.from_kwargs(**kwargs)


def test_defaults_follow_bucket_lists_when_maxima_are_not_given():
    c = _resolve(8192, block_size=128, max_model_len=4096, additional_config={"neuron_config": {
        "num_seqs_buckets": [1, 2, 4, 8], "kv_segment_size_buckets": [2048], "num_batched_tokens_buckets": [2048],
        "on_device_sampling_config": {"all_greedy": True}}})
    nc = c.neuron_config
    assert (c.max_num_seqs, c.max_num_batched_tokens) == (8, 2048)
    assert nc.num_seqs_buckets == [1, 2, 4, 8] and nc.context_buckets == [4096]


def test_plain_defaults():
    c = _resolve(1024, device="cpu")
    nc = c.neuron_config
    assert (c.max_model_len, c.max_num_seqs, c.max_num_batched_tokens) == (1024, 16, 512)
    # On CPU the default decode buckets grow by 4 (padding is cheap, graphs are not) and prefill buckets
    # start at 32 instead of the seeds' 128 (a prefill step is compute-bound: padding costs in full).
    assert nc.num_batched_tokens_buckets == [32, 64, 128, 256, 512] and nc.num_seqs_buckets == [1, 4, 16]
    assert nc.context_buckets == [1024]


def test_model_limits():
    with pytest.raises(ValueError, match="larger than the model's maximum context"):
        _resolve(2048, max_model_len=4096)
    with pytest.raises(ValueError, match="multiple of block_size"):
        _resolve(2048, max_model_len=1000)
    with pytest.raises(ValueError, match="must equal max_num_batched_tokens"):
        _resolve(2048, max_num_batched_tokens=256, additional_config={
            "neuron_config": {"num_batched_tokens_buckets": [128]}})


def test_cli_flags_map_to_fields():
    c = _cli("/m", "--max-model-len", "1024", "--max-num-seqs", "4", "--no-enable-prefix-caching",
             "--enforce-eager", "--block-size", "16", "--num-gpu-blocks-override", "99", "--dtype", "float32",
             "--additional-config", '{"neuron_config": {"num_seqs_buckets": [2, 4]}}', "--scheduling-policy",
             "priority")
    assert (c.model, c.max_model_len, c.max_num_seqs, c.enable_prefix_caching, c.enforce_eager) == \
        ("/m", 1024, 4, False, True)
    assert (c.block_size, c.num_gpu_blocks_override, c.dtype) == (16, 99, "float32")
    assert c.additional_config.neuron_config.num_seqs_buckets == [2, 4]
    assert c.scheduling_policy == "priority"


def test_cli_refuses_vllm_quantization_flag_and_conflicting_models():
    with pytest.raises(ValueError, match="--quantization"):
        _cli("--quantization", "neuron_quant")
    with pytest.raises(ValueError, match="conflicting models"):
        _cli("/a", "--model", "/b")


def test_async_scheduling_default_and_on_device_sampling(monkeypatch):
    import torch

    # CPU with torch on every core: the host is the device, so the default is off (explicit on is honoured).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    c = _resolve(max_model_len=256, device="cpu")
    assert c.async_scheduling is False and "--async-scheduling" in c.async_scheduling_reason
    assert _resolve(max_model_len=256, device="cpu", async_scheduling=True).async_scheduling is True
    # Spare cores for host work: on by default.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert _resolve(max_model_len=256, device="cpu").async_scheduling is True
    assert _resolve(max_model_len=256, async_scheduling=False).async_scheduling is False
    cpu = _resolve(max_model_len=256, additional_config={"neuron_config": {"on_device_sampling_config": None}})
    assert cpu.async_scheduling is False  # CPU sampling: the default turns async off
    with pytest.raises(ValueError, match="async_scheduling=True requires on-device sampling"):
        EngineArgs.from_kwargs(max_model_len=256, async_scheduling=True, additional_config={
            "neuron_config": {"on_device_sampling_config": None}})


def test_no_async_scheduling_flag():
    c = _cli("--no-async-scheduling")
    assert c.async_scheduling is False


@pytest.mark.parametrize("flag, needle", [
    (["--mm-encoder-only"], "mm_encoder_only .* needs --ec-transfer-config"),
    (["--ec-transfer-config", '{"ec_role": "ec_producer"}'], "ec_transfer_config needs ec_connector"),
])
def test_epd_flags_parse_and_are_checked(flag, needle):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(flag)  # not argparse's "unrecognized arguments"
    with pytest.raises(ValueError, match=needle):
        engine_args_from_cli(args)


def test_epd_flags_are_refused_for_text_models(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ec = json.dumps({"ec_connector": "ECSharedStorageConnector", "ec_role": "ec_producer",
                     "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    cfg = engine_args_from_cli(parser.parse_args(["--mm-encoder-only", "--ec-transfer-config", ec]))
    assert cfg.mm_encoder_only and cfg.ec_transfer_config.ec_connector == "ECSharedStorageConnector"
    with pytest.raises(ValueError, match=r"encoder-disaggregated serving\) apply to multimodal models only"):
        resolve(cfg, ModelFacts(2048))


def test_multimodal_options_are_validated_and_refused_for_text_models():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_args_from_cli(parser.parse_args(["--limit-mm-per-prompt", '{"image": 4}',
                                                  "--mm-processor-kwargs", '{"max_pixels": 50176}']))
    assert cfg.limit_mm_per_prompt == {"image": 4} and cfg.mm_processor_kwargs == {"max_pixels": 50176}
    with pytest.raises(ValueError, match="limit_mm_per_prompt applies to multimodal models only"):
        resolve(cfg, ModelFacts(2048))
    with pytest.raises(ValueError, match="modality='speech' is not valid; valid values: \\['image', 'video', 'audio'\\]"):
        EngineArgs.from_kwargs(limit_mm_per_prompt={"speech": 1})
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        EngineArgs.from_kwargs(limit_mm_per_prompt='{"image": -1}')
    with pytest.raises(ValueError, match="not an existing folder"):
        EngineArgs.from_kwargs(allowed_local_media_path="/no/such/folder")
    with pytest.raises(ValueError, match="mm_language_model_only applies to multimodal models only"):
        _resolve(additional_config={"mm_language_model_only": True})


def test_encoder_neuron_config_needs_a_multimodal_model_and_one_device():
    vlm = ModelFacts(2048, multimodal=True)
    with pytest.raises(ValueError, match="encoder_neuron_config applies to multimodal models only"):
        _resolve(additional_config={"encoder_neuron_config": {"encoder_attention_block_size": 256}})
    tp = EngineArgs.from_kwargs(additional_config={"encoder_neuron_config": {"tp_size": 2, "dp_size": 1}})
    with pytest.raises(ValueError, match="tp_size \\* dp_size must equal world_size"):
        resolve(tp, vlm)
    hold = EngineArgs.from_kwargs(additional_config={"encoder_neuron_config": {"encoder_cache_min_hold_time_ms": 5}})
    assert resolve(hold, vlm).additional_config.encoder_neuron_config.min_hold_time_ms(epd=False) == 5.0
    resolve(EngineArgs.from_kwargs(additional_config={"encoder_neuron_config": {"encoder_attention_block_size": 256}}),
            vlm)


def test_resolved_config_cannot_be_mutated():
    c = _resolve(max_model_len=256, data_parallel_size=2)
    for name, value in [("max_model_len", 512), ("kv_budget_shared_by", 1), ("gpu_memory_utilization", 0.5),
                        ("device", "cuda"), ("dtype", "float16"), ("additional_config", None),
                        ("runner_choice", None), ("not_an_option", 1)]:
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot assign to field '{name}'"):
            setattr(c, name, value)
    # What it holds is frozen too: the buckets' owner, the sampling config, the runner choice.
    with pytest.raises(dataclasses.FrozenInstanceError, match="'num_seqs_buckets'"):
        c.neuron_config.num_seqs_buckets = [1]
    with pytest.raises(dataclasses.FrozenInstanceError, match="'top_k'"):
        c.neuron_config.on_device_sampling_config.top_k = 1
    with pytest.raises(dataclasses.FrozenInstanceError, match="'use_v2'"):
        c.runner_choice.use_v2 = False
    with pytest.raises(dataclasses.FrozenInstanceError, match="'neuron_config'"):
        c.additional_config.neuron_config = None
    with pytest.raises(dataclasses.FrozenInstanceError, match="'max_model_len'"):
        del c.max_model_len
    # The engine processes get the same object (pickled), still frozen.
    copy = pickle.loads(pickle.dumps(c))
    assert copy == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.max_num_seqs = 1


def test_resolved_device_dtype_and_backend_with_the_reason(monkeypatch):
    from vllm_neuron.config import device as D

    c = _resolve(device="cpu", dtype="float32")
    assert (c.device, c.dtype, c.backend) == ("cpu", "float32", "native")
    assert (c.torch_device, c.torch_dtype, c.dtype_reason) == (torch.device("cpu"), torch.float32, "set by --dtype")
    monkeypatch.setattr(D, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(D, "_cpuinfo_has_fast_bf16", lambda: False)
    monkeypatch.setattr(cpu_class, "cpu_flags", lambda: {"sse2"})
    auto = _resolve(device="cpu", enforce_eager=True)
    assert (auto.dtype, auto.torch_dtype, auto.backend) == ("float32", torch.float32, "eager")
    assert auto.dtype_reason == ("auto: this CPU has neither AVX512-BF16 nor AMX (generic class), where bf16 "
                                 "matmuls are emulated, so float32")
    assert _resolve(device="cpu", dtype="half").dtype == "float16"
    assert _resolve(device="cpu", dtype=torch.bfloat16).torch_dtype == torch.bfloat16
    monkeypatch.setenv("VLLM_NEURON_BACKEND", "eager")
    assert _resolve(device="cpu").backend == "eager"


def test_forcing_the_avx2_class_takes_its_dtype(monkeypatch):
    """VLLM_NEURON_CPU_ISA=avx2 on an AVX512-BF16 CPU runs it as the AVX2 class: bfloat16 by default (its kernels
    widen bf16 to fp32), float32 where the kernels are off or the class is generic, saying why each time."""
    from vllm_neuron.config import device as D

    monkeypatch.setattr(D, "_cpuinfo_has_fast_bf16", lambda: True)
    monkeypatch.setattr(cpu_class, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512bw", "avx512_bf16"})
    assert _resolve(device="cpu").dtype == "bfloat16"
    monkeypatch.setenv("VLLM_NEURON_CPU_ISA", "avx2")
    c = _resolve(device="cpu")
    assert c.dtype == "bfloat16"
    assert c.dtype_reason.startswith("auto: VLLM_NEURON_CPU_ISA=avx2 runs this CPU as the avx2 class: bf16 "
                                     "weights widened to fp32 in the kernels")
    monkeypatch.setenv("VLLM_NEURON_DISABLE_NKI_KERNELS", "1")
    off = _resolve(device="cpu")
    assert off.dtype == "float32" and "VLLM_NEURON_DISABLE_NKI_KERNELS=1 turns off" in off.dtype_reason
    monkeypatch.delenv("VLLM_NEURON_DISABLE_NKI_KERNELS")
    monkeypatch.setenv("VLLM_NEURON_CPU_ISA", "generic")
    g = _resolve(device="cpu")
    assert g.dtype == "float32" and g.dtype_reason.startswith(
        "auto: VLLM_NEURON_CPU_ISA=generic runs this CPU as the generic class, where bf16 matmuls are emulated")
    monkeypatch.setattr(cpu_class, "cpu_flags", lambda: {"avx2", "fma", "f16c"})  # an AVX2-only CPU, nothing forced
    monkeypatch.setattr(D, "_cpuinfo_has_fast_bf16", lambda: False)
    monkeypatch.delenv("VLLM_NEURON_CPU_ISA")
    native = _resolve(device="cpu")
    assert native.dtype == "bfloat16" and native.dtype_reason.startswith(
        "auto: this CPU has neither AVX512-BF16 nor AMX (avx2 class): bf16 weights widened")


def test_bf16_quantization_is_the_seeds_unquantized_bfloat16(monkeypatch):
    """Seed 000's Qwen3-VL example sets neuron_config.quantization "bf16": unquantized bfloat16 weights."""
    from vllm_neuron.config import device as D

    monkeypatch.setattr(D, "cpu_has_fast_bf16", lambda: False)  # auto alone would pick float32 here
    bf16 = {"neuron_config": {"quantization": "bf16"}}
    c = resolve(EngineArgs.from_kwargs(device="cpu", additional_config=bf16), ModelFacts(2048, multimodal=True))
    assert (c.dtype, c.neuron_config.quantization) == ("bfloat16", None)
    assert c.dtype_reason == "neuron_config.quantization='bf16': unquantized bfloat16 weights"
    assert _resolve(device="cpu", dtype="bfloat16", additional_config=bf16).dtype == "bfloat16"
    with pytest.raises(ValueError, match="quantization='bf16' asks for unquantized bfloat16 weights, but "
                                         "dtype='float32'; remove one of them"):
        EngineArgs.from_kwargs(device="cpu", dtype="float32", additional_config=bf16)


@pytest.mark.parametrize("value, ok", [(-1, True), (0, True), (50, True), (-2, False), (True, False), ("5", False)])
def test_max_logprobs_takes_minus_one_for_the_whole_vocabulary(value, ok):
    if ok:
        assert EngineArgs.from_kwargs(max_logprobs=value).max_logprobs == value
    else:
        with pytest.raises(ValueError, match=r"max_logprobs must be a non-negative integer \(or -1: the whole "
                                             "vocabulary\\)"):
            EngineArgs.from_kwargs(max_logprobs=value)
