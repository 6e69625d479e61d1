"""additional_config parsing: neuron_config, encoder_neuron_config, EPD roles, seeds' rules."""

import json

import pytest

from vllm_neuron.config.neuron_config import (
    QUANTIZATIONS,
    AdditionalConfig,
    EncoderNeuronConfig,
    NeuronConfig,
    OnDeviceSamplingConfig,
    VisionNeuronConfig,
    parse_additional_config,
)

LIMITS = dict(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=4096, block_size=32)


# --- on_device_sampling_config ---

def test_on_device_sampling_is_on_by_default_and_null_selects_cpu():
    assert NeuronConfig().on_device_sampling
    assert NeuronConfig.from_dict({}).on_device_sampling_config == OnDeviceSamplingConfig()
    cfg = NeuronConfig.from_dict({"on_device_sampling_config": None})
    assert cfg.on_device_sampling_config is None and not cfg.on_device_sampling
    # via JSON, as on the command line
    cfg = parse_additional_config('{"neuron_config": {"on_device_sampling_config": null}}')
    assert cfg.neuron_config.on_device_sampling_config is None


def test_sampling_config_accepts_seed_examples():
    greedy = OnDeviceSamplingConfig.from_value({"all_greedy": True})
    assert greedy.all_greedy and greedy.top_k == 256
    temp = OnDeviceSamplingConfig.from_value({"temperature": "0.7"})
    assert temp.temperature == pytest.approx(0.7) and not temp.all_greedy
    zero = OnDeviceSamplingConfig.from_value({"temperature": "0"})
    assert zero.all_greedy  # temperature 0 means all_greedy
    assert OnDeviceSamplingConfig(top_k="64", top_p="0.9").top_k == 64


def test_sampling_config_errors():
    with pytest.raises(ValueError, match="temperature must be a number"):
        OnDeviceSamplingConfig(temperature="warm")
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        OnDeviceSamplingConfig(temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        OnDeviceSamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        OnDeviceSamplingConfig(top_k=-3)
    with pytest.raises(ValueError, match="all_greedy must be true or false"):
        OnDeviceSamplingConfig(all_greedy="yes")
    with pytest.raises(ValueError, match="unknown on_device_sampling_config option 'min_p'") as e:
        OnDeviceSamplingConfig.from_value({"min_p": 0.1})
    assert "all_greedy, temperature, top_k, top_p" in str(e.value)
    with pytest.raises(ValueError, match="object or null"):
        OnDeviceSamplingConfig.from_value(True)


def test_greedy_only_rejects_sampling_requests():
    cfg = OnDeviceSamplingConfig(all_greedy=True)
    cfg.check_request(0.0)
    with pytest.raises(ValueError, match="^Only support greedy sampling"):
        cfg.check_request(0.7)
    OnDeviceSamplingConfig().check_request(0.7)  # not all_greedy: fine


def test_request_defaults_and_top_k():
    assert OnDeviceSamplingConfig().request_defaults() == {}
    assert OnDeviceSamplingConfig(temperature="0.7", top_p=0.9).request_defaults() == {
        "temperature": pytest.approx(0.7), "top_p": 0.9,
    }
    assert OnDeviceSamplingConfig(all_greedy=True).request_defaults() == {"temperature": 0.0}
    cfg = OnDeviceSamplingConfig()
    assert cfg.effective_top_k(-1) == 0 and cfg.effective_top_k(0) == 0  # off: the whole vocabulary
    assert cfg.effective_top_k(40) == 40
    assert cfg.effective_top_k(1000) == 256
    assert OnDeviceSamplingConfig(top_k=-1).top_k == 256


# --- neuron_config keys and values ---

def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError) as e:
        NeuronConfig.from_dict({"num_seq_buckets": [1, 2]})
    msg = str(e.value)
    assert "'num_seq_buckets'" in msg
    for key in NeuronConfig.OPTIONS:
        assert key in msg


@pytest.mark.parametrize(
    "key, flag",
    [
        ("block_size", "--block-size"),
        ("num_gpu_blocks_override", "--num-gpu-blocks-override"),
        ("enable_prefix_caching", "--no-enable-prefix-caching"),
        ("kv_cache_dtype", "--kv-cache-dtype"),
        ("max_num_seqs", "--max-num-seqs"),
    ],
)
def test_vllm_parameters_inside_neuron_config(key, flag):
    with pytest.raises(ValueError) as e:
        NeuronConfig.from_dict({key: 1})
    assert f"'{key}' is a vLLM parameter, not a neuron_config option" in str(e.value)
    assert flag in str(e.value)


@pytest.mark.parametrize("namespace", ["neuron_config", "encoder_neuron_config"])
def test_nested_mm_language_model_only_is_an_error(namespace):
    with pytest.raises(ValueError, match="must be at the top level of additional_config"):
        parse_additional_config({namespace: {"mm_language_model_only": True}})


def test_options_of_the_other_namespace_say_where_they_go():
    with pytest.raises(ValueError, match="'tp_size' is an option of encoder_neuron_config"):
        NeuronConfig.from_dict({"tp_size": 2})
    with pytest.raises(ValueError, match="'ep_degree' is an option of neuron_config"):
        EncoderNeuronConfig.from_dict({"ep_degree": 2})
    with pytest.raises(ValueError, match="must be nested under neuron_config"):
        parse_additional_config({"num_seqs_buckets": [1, 2]})


def test_quantization_names_listed_are_the_accepted_ones():
    for name in QUANTIZATIONS:
        assert NeuronConfig(quantization=name).quantization == name
    for name, problem in (("fp8", "is not valid"), ("mxfp8", "is not supported yet by vllm-neuron")):
        with pytest.raises(ValueError) as e:
            NeuronConfig.from_dict({"quantization": name})
        message = str(e.value)
        assert f"quantization={name!r} {problem}" in message
        listed = message.split("valid values: ")[1]
        # The error lists exactly the values accepted above, and not the refused one.
        assert [v.split(" (")[0] for v in listed.split(". ")[0].split("; ")] == list(QUANTIZATIONS)
        assert "mxfp8" not in listed


def test_value_types_are_checked_where_they_enter():
    with pytest.raises(ValueError, match="num_seqs_buckets"):
        NeuronConfig.from_dict({"num_seqs_buckets": [1, "two"]})
    with pytest.raises(ValueError, match="ep_degree must be a positive integer, got 0"):
        NeuronConfig.from_dict({"ep_degree": 0})
    with pytest.raises(ValueError, match="fp8_packed_kv must be true or false"):
        NeuronConfig.from_dict({"fp8_packed_kv": 1})
    with pytest.raises(ValueError, match="neuron_config must be an object"):
        NeuronConfig.from_dict([1, 2])


# --- resolution and the seeds' bucket rules ---

def test_resolved_fills_defaults():
    cfg = NeuronConfig().resolved(**LIMITS)
    assert cfg.num_batched_tokens_buckets == [128, 256, 512, 1024, 2048]
    assert cfg.num_seqs_buckets == [1, 2, 4, 8]
    assert cfg.context_buckets == [4096]
    assert cfg.decode_context_length_buckets is None
    assert cfg.ep_degree == 1
    assert cfg.resolved(**LIMITS) == cfg  # idempotent


def test_resolved_keeps_user_lists_and_adds_max_context():
    cfg = NeuronConfig.from_dict(
        {"num_batched_tokens_buckets": [512, 2048], "num_seqs_buckets": [2, 8],
         "decode_context_length_buckets": [1024]}
    ).resolved(**LIMITS)
    assert cfg.num_batched_tokens_buckets == [512, 2048]
    assert cfg.num_seqs_buckets == [2, 8]
    assert cfg.context_buckets == [1024, 4096]
    assert cfg.decode_context_length_buckets == [1024]


def test_validate_applies_bucket_rules():
    with pytest.raises(ValueError, match="must equal max_num_batched_tokens=2048"):
        NeuronConfig(num_batched_tokens_buckets=[128, 1024]).validate(**LIMITS)
    with pytest.raises(ValueError, match="must equal max_num_seqs=8"):
        NeuronConfig(num_seqs_buckets=[1, 4]).validate(**LIMITS)
    with pytest.raises(ValueError, match="< max_model_len=4096"):
        NeuronConfig(decode_context_length_buckets=[8192]).validate(**LIMITS)


def test_segmented_prefill_buckets():
    # The seeds' complete example: both lists [2048].
    cfg = NeuronConfig.from_dict(
        {"kv_segment_size_buckets": [2048], "num_batched_tokens_buckets": [2048]}
    ).resolved(**LIMITS)
    assert cfg.kv_segment_size_buckets == [2048]
    # Only the segment list given: the prefill list defaults to it.
    cfg = NeuronConfig(kv_segment_size_buckets=[2048]).resolved(**LIMITS)
    assert cfg.num_batched_tokens_buckets == [2048]
    with pytest.raises(ValueError, match="must currently be identical"):
        NeuronConfig(kv_segment_size_buckets=[2048], num_batched_tokens_buckets=[1024, 2048]).validate(**LIMITS)


# --- parallelism rules ---

def test_ep_degree_requires_enable_expert_parallel():
    with pytest.raises(ValueError, match="^ep_degree requires --enable-expert-parallel"):
        NeuronConfig(ep_degree=2).validate(**LIMITS, tensor_parallel_size=8)


def test_ep_degree_defaults_and_dp_rule():
    assert NeuronConfig().resolved(**LIMITS, enable_expert_parallel=True, tensor_parallel_size=8).ep_degree == 8
    assert NeuronConfig(ep_degree=2).resolved(
        **LIMITS, enable_expert_parallel=True, tensor_parallel_size=8
    ).ep_degree == 2
    with pytest.raises(ValueError, match="ep_degree=3 must divide tensor_parallel_size=8"):
        NeuronConfig(ep_degree=3).validate(**LIMITS, enable_expert_parallel=True, tensor_parallel_size=8)
    # DP + EP: ep_degree must be TP x DP.
    ok = NeuronConfig(ep_degree=16).resolved(
        **LIMITS, enable_expert_parallel=True, tensor_parallel_size=8, data_parallel_size=2
    )
    assert ok.ep_degree == 16
    assert NeuronConfig().resolved(
        **LIMITS, enable_expert_parallel=True, tensor_parallel_size=8, data_parallel_size=2
    ).ep_degree == 16
    with pytest.raises(ValueError, match="ep_degree = TP x DP = 16") as e:
        NeuronConfig(ep_degree=8).validate(
            **LIMITS, enable_expert_parallel=True, tensor_parallel_size=8, data_parallel_size=2
        )
    assert "got ep_degree=8" in str(e.value)


def test_component_dp_refused_with_the_way_to_disaggregate():
    # A disaggregated instance here is one replica with its own TP: the message points at the working setup.
    for cfg, listed in ((NeuronConfig(attention_dp_size=2), "attention_dp_size=2"),
                        (NeuronConfig(mlp_dp_size=2, lm_head_dp_size=2), "mlp_dp_size=2, lm_head_dp_size=2")):
        with pytest.raises(ValueError, match=rf"component data parallelism \({listed}\) is not supported by "
                                             r"vllm-neuron: remove .*--kv-transfer-config.*disagg-proxy"):
            cfg.validate(**LIMITS, tensor_parallel_size=8)


def test_encoder_defaults_and_parallel_inference():
    enc = EncoderNeuronConfig()
    assert enc.encoder_attention_block_size == 2048
    assert enc.parallel_sizes(8) == (1, 8)  # full DP by default
    assert EncoderNeuronConfig(tp_size=2).parallel_sizes(8) == (2, 4)
    assert EncoderNeuronConfig(dp_size=4).parallel_sizes(8) == (2, 4)
    assert EncoderNeuronConfig(tp_size=1, dp_size=8).parallel_sizes(8) == (1, 8)
    with pytest.raises(ValueError, match="tp_size \\* dp_size must equal world_size"):
        EncoderNeuronConfig(tp_size=2, dp_size=2).validate(8)
    with pytest.raises(ValueError, match="tp_size=3 must divide world_size=8"):
        EncoderNeuronConfig(tp_size=3).parallel_sizes(8)


def test_encoder_rules():
    with pytest.raises(ValueError, match="multiple of 128"):
        EncoderNeuronConfig(encoder_attention_block_size=100)
    assert EncoderNeuronConfig(encoder_attention_block_size=128).encoder_attention_block_size == 128
    with pytest.raises(ValueError, match="num_encoder_input_buckets"):
        EncoderNeuronConfig(num_encoder_input_buckets=[8192, 2048])
    assert EncoderNeuronConfig().min_hold_time_ms(epd=True) == 100.0
    assert EncoderNeuronConfig().min_hold_time_ms(epd=False) == 0.0
    assert EncoderNeuronConfig(encoder_cache_min_hold_time_ms=5).min_hold_time_ms(epd=True) == 5.0


def test_encoder_buckets():
    assert EncoderNeuronConfig().input_buckets(20480) == [2048, 4096, 8192, 16384, 20480]
    assert EncoderNeuronConfig(max_encoder_seq_len=8192).input_buckets(20480) == [2048, 4096, 8192]
    assert EncoderNeuronConfig(max_encoder_seq_len=5000).input_buckets(20480) == [2048, 4096, 6144]
    assert EncoderNeuronConfig().input_buckets(100) == [2048]
    explicit = EncoderNeuronConfig(num_encoder_input_buckets=[2048, 8192], max_encoder_seq_len=4096)
    assert explicit.input_buckets(20480) == [2048, 8192]  # max_encoder_seq_len ignored


def test_vision_aliases_from_the_vlm_guide():
    assert VisionNeuronConfig is EncoderNeuronConfig
    cfg = parse_additional_config(
        {"vision_neuron_config": {"num_vision_tokens_buckets": [2048], "vision_attention_block_size": 1024}}
    )
    assert cfg.encoder_neuron_config.num_encoder_input_buckets == [2048]
    assert cfg.encoder_neuron_config.encoder_attention_block_size == 1024
    with pytest.raises(ValueError, match="name the same option"):
        EncoderNeuronConfig.from_dict({"num_vision_tokens_buckets": [2048], "num_encoder_input_buckets": [2048]})


# --- additional_config ---

def test_parse_additional_config_forms():
    assert parse_additional_config(None) == AdditionalConfig()
    assert parse_additional_config("") == AdditionalConfig()
    d = {
        "neuron_config": {"num_seqs_buckets": [1, 2, 4, 8], "on_device_sampling_config": {"all_greedy": True}},
        "encoder_neuron_config": {"tp_size": 1, "dp_size": 8},
        "mm_language_model_only": True,
    }
    from_dict = parse_additional_config(d)
    assert from_dict == parse_additional_config(json.dumps(d))
    assert from_dict.neuron_config.num_seqs_buckets == [1, 2, 4, 8]
    assert from_dict.neuron_config.on_device_sampling_config.all_greedy
    assert from_dict.encoder_neuron_config.dp_size == 8
    assert from_dict.mm_language_model_only
    assert parse_additional_config(from_dict) is from_dict


def test_parse_additional_config_errors():
    with pytest.raises(ValueError, match="^--additional-config is not valid JSON"):
        parse_additional_config('{"neuron_config": {')
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_additional_config("[1, 2]")
    with pytest.raises(ValueError, match="unknown additional_config key 'neuron_cfg'") as e:
        parse_additional_config({"neuron_cfg": {}})
    assert "neuron_config" in str(e.value) and "mm_language_model_only" in str(e.value)
    with pytest.raises(ValueError, match="'mm_encoder_only' is a vLLM parameter.*--mm-encoder-only"):
        parse_additional_config({"mm_encoder_only": True})


def test_epd_roles_are_mutually_exclusive():
    parse_additional_config({"mm_language_model_only": True})
    parse_additional_config({}, mm_encoder_only=True)
    with pytest.raises(ValueError, match="mutually exclusive"):
        parse_additional_config({"mm_language_model_only": True}, mm_encoder_only=True)
