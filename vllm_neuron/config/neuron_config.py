"""The additional_config namespaces: neuron_config, encoder_neuron_config, EPD roles.

    --additional-config '{"neuron_config": {...}, "encoder_neuron_config": {...},
                          "mm_language_model_only": true}'

Option names, defaults and rules are the seeds' configuration reference. Every key is checked
where it enters: an unknown key is a ValueError naming it and listing the valid ones, and a
key that belongs elsewhere (a vLLM parameter, the top-level mm_language_model_only, an option
of the other namespace) says where it goes. Where vLLM Neuron silently ignores a misplaced
key, we do not.

Deliberate choices:
* on_device_sampling_config defaults to ON (an OnDeviceSamplingConfig() with no fixed
  temperature). The reference table says "null (CPU sampling)", but the features guide says
  on-device sampling "is enabled by default", and async scheduling - on by default - requires
  it; we follow the features guide. An explicit JSON null selects host (CPU) sampling.
* quantization names are checked against QUANTIZATIONS here (every listed value is accepted);
  whether a model supports the chosen scheme is checked once the model's config is read. "bf16"
  (the seeds' Qwen3-VL example) asks for no quantization: unquantized bfloat16 weights, so it
  selects dtype bfloat16 and conflicts with another --dtype.
* Every namespace is a frozen dataclass: the resolved engine config holds them, and nothing may
  change them after start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from vllm_neuron.config import buckets as B
from vllm_neuron.config import validate as V
from vllm_neuron.config.json_object import parse_json_object
from vllm_neuron.config.tensor_debug import TensorCaptureConfig, TensorReplacementConfig
from vllm_neuron.logger import init_logger, warning_once

logger = init_logger(__name__)

# neuron_config.quantization values -> what each one does. FP8 static weights come from the checkpoint's
# quantization_config, not from this option.
QUANTIZATIONS = {
    "bf16": "no quantization: bfloat16 weights",
    "int8": "weight-only int8, CPU",
    "int4": "weight-only int4, CPU",
    "mxfp4": "gpt-oss experts kept in MXFP4",
}
NOT_BUILT_QUANTIZATIONS = ("mxfp8",)  # named by the seeds, refused here as not built yet
DEFAULT_ON_DEVICE_TOP_K = 256
COMPONENT_DP_OPTIONS = ("attention_dp_size", "embedding_dp_size", "mlp_dp_size", "lm_head_dp_size")

# vLLM parameters that users put inside neuron_config by mistake -> where they go instead.
VLLM_PARAMETERS = {
    **{k: "--" + k.replace("_", "-") for k in (
        "block_size", "num_gpu_blocks_override", "kv_cache_dtype", "max_num_seqs",
        "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "tensor_parallel_size",
        "data_parallel_size", "enable_expert_parallel", "enable_prompt_embeds", "enforce_eager",
        "speculative_config", "kv_transfer_config", "mm_encoder_only",
    )},
    "enable_prefix_caching": "--enable-prefix-caching / --no-enable-prefix-caching",
    "async_scheduling": "--async-scheduling / --no-async-scheduling",
}

ONLY_GREEDY_MESSAGE = (
    "Only support greedy sampling: on_device_sampling_config has all_greedy=true, so requests "
    "must use temperature=0 (got temperature={temperature}). For non-greedy sampling, remove "
    "all_greedy, or set on_device_sampling_config to null to use CPU sampling."
)


# --- value coercion (JSON gives ints/floats/strings; the seeds' examples quote numbers: "0.7") ---

def _number(option: str, value: Any, **bounds: Any) -> float:
    return V.number(option, value, from_text=True, **bounds)


def _integer(option: str, value: Any, minimum: int | None = 1) -> int:
    return V.integer(option, value, minimum=minimum, from_text=True)


def check_quantization(value: Any) -> str | None:
    """neuron_config.quantization: None (unset) or one of QUANTIZATIONS."""
    if value is None or (isinstance(value, str) and value in QUANTIZATIONS):
        return value
    valid = "; ".join(f"{name} ({what})" for name, what in QUANTIZATIONS.items())
    problem = "is not supported yet by vllm-neuron" if value in NOT_BUILT_QUANTIZATIONS else "is not valid"
    raise ValueError(f"neuron_config.quantization={value!r} {problem}; valid values: {valid}. FP8 static weights "
                     "come from the checkpoint's quantization_config, not from this option")


def _opt_list(option: str, value: Any) -> list[int] | None:
    return None if value is None else B.validate_bucket_list(option, value)


def _check_keys(namespace: str, data: Mapping[str, Any], valid: Sequence[str], elsewhere: Mapping[str, str]) -> None:
    """Reject keys not in `valid`; `elsewhere` maps keys of another namespace to its name."""
    for key in data:
        if key in valid:
            continue
        if key == "mm_language_model_only":
            raise ValueError(
                f"mm_language_model_only must be at the top level of additional_config, not "
                f"inside {namespace} (it is a sibling of neuron_config and encoder_neuron_config)"
            )
        if key in VLLM_PARAMETERS:
            raise ValueError(
                f"{key!r} is a vLLM parameter, not a {namespace} option; pass "
                f"{VLLM_PARAMETERS[key]} on the command line or {key}=... to LLM(...)"
            )
        if key in elsewhere:
            raise ValueError(f"{key!r} is an option of {elsewhere[key]}, not of {namespace}; move it there")
        raise ValueError(f"unknown {namespace} option {key!r}; valid options: {', '.join(sorted(valid))}")


# --- on-device sampling ---

def _set_fields(obj: Any, **values: Any) -> None:
    """__post_init__ of a frozen dataclass storing its normalized values (the only writes they ever get)."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class OnDeviceSamplingConfig:
    """neuron_config.on_device_sampling_config: sampling inside the compiled graph.

    * all_greedy: the graph only takes the argmax; a request with temperature > 0 is rejected
      with "Only support greedy sampling" (check_request). A temperature of 0 here also means
      all_greedy.
    * top_k: the in-graph top-k width (requests with a larger top_k are sampled on the host). A
      request with top_k -1 or 0 (off) samples the whole vocabulary; with top_p < 1 its top-p set is
      cut at this many tokens, in the graph and on the host alike (the seeds' "top_k -1 is internally
      limited to 256", narrowed to where it matters).
    * temperature / top_p: when set, the defaults for requests that do not set their own
      (request_defaults()). Numbers may be given as strings ("0.7", "0"), as in the seeds.
    """

    all_greedy: bool = False
    temperature: float | None = None
    top_k: int = DEFAULT_ON_DEVICE_TOP_K
    top_p: float | None = None

    def __post_init__(self) -> None:
        ns = "on_device_sampling_config"
        all_greedy = V.boolean(f"{ns}.all_greedy", self.all_greedy)
        temperature = None if self.temperature is None else \
            _number(f"{ns}.temperature", self.temperature, minimum=0.0)
        top_k = _integer(f"{ns}.top_k", self.top_k, minimum=None)
        if top_k in (-1, 0):
            top_k = DEFAULT_ON_DEVICE_TOP_K
        elif top_k < 1:
            raise ValueError(f"{ns}.top_k must be a positive integer, or -1 for {DEFAULT_ON_DEVICE_TOP_K}; got {top_k}")
        top_p = None if self.top_p is None else \
            _number(f"{ns}.top_p", self.top_p, minimum=0.0, maximum=1.0, min_exclusive=True)
        _set_fields(self, all_greedy=all_greedy or temperature == 0, temperature=temperature, top_k=top_k,
                    top_p=top_p)

    @classmethod
    def from_value(cls, value: Any) -> OnDeviceSamplingConfig | None:
        """None -> None (host sampling); a dict -> a config; an instance passes through."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                f"on_device_sampling_config must be an object or null, got {value!r}; "
                "supported sub-parameters: all_greedy, temperature, top_k, top_p"
            )
        valid = tuple(f.name for f in dataclasses.fields(cls))
        _check_keys("on_device_sampling_config", value, valid, {})
        return cls(**value)

    def request_defaults(self) -> dict[str, float]:
        """Sampling defaults for requests that leave these fields unset."""
        out: dict[str, float] = {}
        if self.all_greedy:
            out["temperature"] = 0.0
        elif self.temperature is not None:
            out["temperature"] = self.temperature
        if self.top_p is not None:
            out["top_p"] = self.top_p
        return out

    def check_request(self, temperature: float) -> None:
        """Raise the seeds' "Only support greedy sampling" error for a non-greedy request
        under all_greedy."""
        if self.all_greedy and temperature > 0:
            raise ValueError(ONLY_GREEDY_MESSAGE.format(temperature=temperature))

    def effective_top_k(self, request_top_k: int) -> int:
        """A request's top_k inside the graph: -1/0 (off) stays off (the whole vocabulary; top-p then
        looks at no more than `top_k` tokens); values above the graph's width become the width (such
        requests are sampled on the host)."""
        if request_top_k <= 0:
            return 0
        return min(request_top_k, self.top_k)


# --- neuron_config ---

@dataclass(frozen=True)
class NeuronConfig:
    """neuron_config: text-model options (compilation buckets, sampling, quantization, parallel).

    Lifecycle: parse with from_dict() (keys, types and ranges checked), then call
    resolved(max_num_batched_tokens=..., max_num_seqs=..., ...) once the vLLM parameters are
    known. resolved() runs validate() (bucket rules and parallelism rules) and returns a new
    NeuronConfig whose num_batched_tokens_buckets, num_seqs_buckets, ep_degree and
    context_buckets are concrete: the lists the scheduler and the runner use. The user's
    decode_context_length_buckets is kept as given (None means the feature is off).
    """

    num_batched_tokens_buckets: list[int] | None = None
    num_seqs_buckets: list[int] | None = None
    kv_segment_size_buckets: list[int] | None = None
    decode_context_length_buckets: list[int] | None = None
    on_device_sampling_config: OnDeviceSamplingConfig | None = field(default_factory=OnDeviceSamplingConfig)
    quantization: str | None = None
    ep_degree: int | None = None
    attention_dp_size: int = 1
    embedding_dp_size: int = 1
    mlp_dp_size: int = 1
    lm_head_dp_size: int = 1
    fp8_packed_kv: bool = False
    gk_decode: bool = False
    # Decode graphs through inductor's C++ wrapper: a faster step for several times the compile time.
    decode_cpp_wrapper: bool = False
    # int4 / int8 weights against activations made int8 per group of 32 (AVX512-VNNI CPUs; int4 at every row
    # count, int8 from two rows on):
    # None where built, False never, True or refused where not built.
    int8_activations: bool | None = None
    # Accuracy debugging (config/tensor_debug.py): module outputs written out, or fed from a file.
    tensor_capture: TensorCaptureConfig | None = None
    tensor_replacement: TensorReplacementConfig | None = None
    # Filled by resolved(): decode context lengths to compile (max_model_len always last).
    # Not a user option.
    context_buckets: list[int] | None = None

    OPTIONS = (
        "num_batched_tokens_buckets", "num_seqs_buckets", "kv_segment_size_buckets",
        "decode_context_length_buckets", "on_device_sampling_config", "quantization",
        "ep_degree", *COMPONENT_DP_OPTIONS, "fp8_packed_kv", "gk_decode", "decode_cpp_wrapper",
        "int8_activations", "tensor_capture", "tensor_replacement",
    )

    def __post_init__(self) -> None:
        lists = {name: _opt_list(name, getattr(self, name)) for name in (
            "num_batched_tokens_buckets", "num_seqs_buckets", "kv_segment_size_buckets",
            "decode_context_length_buckets", "context_buckets")}
        _set_fields(self, **lists,
                    on_device_sampling_config=OnDeviceSamplingConfig.from_value(self.on_device_sampling_config),
                    quantization=check_quantization(self.quantization),
                    tensor_capture=TensorCaptureConfig.from_value(self.tensor_capture),
                    tensor_replacement=TensorReplacementConfig.from_value(self.tensor_replacement),
                    ep_degree=None if self.ep_degree is None else _integer("ep_degree", self.ep_degree),
                    **{name: _integer(name, getattr(self, name)) for name in COMPONENT_DP_OPTIONS},
                    **{name: V.boolean(name, getattr(self, name))
                       for name in ("fp8_packed_kv", "gk_decode", "decode_cpp_wrapper")},
                    int8_activations=None if self.int8_activations is None
                    else V.boolean("int8_activations", self.int8_activations))
        if self.int8_activations and self.quantization not in ("int4", "int8"):
            raise ValueError(f"neuron_config.int8_activations=True applies to int4 and int8 weights only; set "
                             f"neuron_config.quantization to 'int4' or 'int8' (got {self.quantization!r}) or leave "
                             "it unset")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> NeuronConfig:
        """Parse the neuron_config object. A missing on_device_sampling_config keeps the
        default (on-device sampling on); an explicit null selects CPU sampling."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError(f"neuron_config must be an object, got {data!r}")
        _check_keys("neuron_config", data, cls.OPTIONS, _ENCODER_KEYS)
        return cls(**data)

    @property
    def on_device_sampling(self) -> bool:
        return self.on_device_sampling_config is not None

    @property
    def component_dp(self) -> dict[str, int]:
        """The component data-parallel options set above 1."""
        return {n: getattr(self, n) for n in COMPONENT_DP_OPTIONS if getattr(self, n) > 1}

    def _prefill_buckets(self, max_num_batched_tokens: int, start: int = B.MIN_DEFAULT_PREFILL_BUCKET) -> list[int]:
        if self.num_batched_tokens_buckets is not None:
            return self.num_batched_tokens_buckets
        if self.kv_segment_size_buckets is not None:
            # Segmented prefill needs the two lists identical; default to the segment list.
            return list(self.kv_segment_size_buckets)
        return B.default_prefill_buckets(max_num_batched_tokens, start)

    def _ep_degree(self, enable_expert_parallel: bool, tp: int, dp: int) -> int:
        if not enable_expert_parallel:
            return 1
        if self.ep_degree is not None:
            return self.ep_degree
        # Seeds: full EP defaults ep_degree to TP; with DP the only accepted value is TP x DP.
        return tp * dp

    def validate(
        self, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
        enable_expert_parallel: bool = False, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
    ) -> None:
        """Apply the bucket rules and the parallelism rules; ValueError on the first broken one."""
        prefill = B.validate_prefill_buckets(self._prefill_buckets(max_num_batched_tokens), max_num_batched_tokens)
        if self.num_seqs_buckets is not None:
            B.validate_decode_buckets(self.num_seqs_buckets, max_num_seqs)
        else:
            B.default_decode_buckets(max_num_seqs)
        B.validate_context_buckets(self.decode_context_length_buckets, max_model_len, block_size)
        B.validate_kv_segment_buckets(self.kv_segment_size_buckets, prefill, block_size)
        self.validate_parallel(enable_expert_parallel, tensor_parallel_size, data_parallel_size)

    def validate_parallel(self, enable_ep: bool, tp: int, dp: int) -> None:
        tp = _integer("tensor_parallel_size", tp)
        dp = _integer("data_parallel_size", dp)
        if self.ep_degree is not None and self.ep_degree > 1 and not enable_ep:
            raise ValueError(
                f"ep_degree requires --enable-expert-parallel: neuron_config sets "
                f"ep_degree={self.ep_degree} but expert parallelism is off. Pass "
                "--enable-expert-parallel (enable_expert_parallel=True) or remove ep_degree."
            )
        if enable_ep:
            ep = self._ep_degree(True, tp, dp)
            if dp > 1 and ep != tp * dp:
                raise ValueError(
                    f"Combining data parallelism with expert parallelism requires ep_degree = "
                    f"TP x DP = {tp * dp} (tensor_parallel_size={tp}, data_parallel_size={dp}); "
                    f"got ep_degree={ep}. Other combinations are rejected."
                )
            if dp == 1 and tp % ep:
                raise ValueError(f"ep_degree={ep} must divide tensor_parallel_size={tp}")
        comp = self.component_dp
        if comp:
            listed = ", ".join(f"{k}={v}" for k, v in comp.items())
            # The seeds shard attention / MoE over data-parallel groups inside one disaggregated instance; here a
            # disaggregated instance is one replica with its own tensor parallelism, so there is nothing to shard.
            raise ValueError(
                f"component data parallelism ({listed}) is not supported by vllm-neuron: remove "
                f"{' and '.join(comp)}. For disaggregated inference run prefill and decode instances, each with "
                "its own --tensor-parallel-size and --kv-transfer-config, behind `vllm-neuron disagg-proxy` "
                "(README: Disaggregated prefill/decode)"
            )

    def resolved(
        self, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
        enable_expert_parallel: bool = False, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
        decode_bucket_factor: int = 2,
        prefill_bucket_start: int = B.MIN_DEFAULT_PREFILL_BUCKET,
    ) -> NeuronConfig:
        """validate(), then a copy with every default filled (see the class docstring).
        decode_bucket_factor: growth of the default num_seqs_buckets (2: the seeds' powers of two);
        prefill_bucket_start: smallest default num_batched_tokens_bucket (the seeds' 128)."""
        self.validate(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=block_size,
            enable_expert_parallel=enable_expert_parallel, tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
        )
        return dataclasses.replace(
            self,
            num_batched_tokens_buckets=self._prefill_buckets(max_num_batched_tokens, prefill_bucket_start),
            num_seqs_buckets=self.num_seqs_buckets or B.default_decode_buckets(max_num_seqs, decode_bucket_factor),
            ep_degree=self._ep_degree(enable_expert_parallel, tensor_parallel_size, data_parallel_size),
            context_buckets=B.context_buckets(self.decode_context_length_buckets, max_model_len),
        )


# --- encoder_neuron_config ---

# The VLM onboarding guide names two options differently; accept those spellings too.
_ENCODER_ALIASES = {
    "num_vision_tokens_buckets": "num_encoder_input_buckets",
    "vision_attention_block_size": "encoder_attention_block_size",
}
ENCODER_BLOCK_MULTIPLE = 128
EPD_MIN_HOLD_TIME_MS = 100.0


@dataclass(frozen=True)
class EncoderNeuronConfig:
    """encoder_neuron_config: multimodal encoder options.

    tp_size / dp_size default to None ("left at 1"): whichever is unset is inferred from the
    world size, and with neither set the encoder runs full DP (tp 1, dp world_size). When both
    are set, tp_size * dp_size must equal world_size (parallel_sizes()).
    """

    num_encoder_input_buckets: list[int] | None = None
    encoder_attention_block_size: int = 2048
    max_encoder_seq_len: int | None = None
    tp_size: int | None = None
    dp_size: int | None = None
    encoder_cache_num_blocks: int | None = None
    encoder_cache_min_hold_time_ms: float | None = None

    def __post_init__(self) -> None:
        size = _integer("encoder_attention_block_size", self.encoder_attention_block_size)
        if size % ENCODER_BLOCK_MULTIPLE:
            raise ValueError(f"encoder_attention_block_size must be a multiple of {ENCODER_BLOCK_MULTIPLE}, got {size}")
        hold = self.encoder_cache_min_hold_time_ms
        _set_fields(self, num_encoder_input_buckets=_opt_list("num_encoder_input_buckets",
                                                              self.num_encoder_input_buckets),
                    encoder_attention_block_size=size,
                    **{name: _integer(name, getattr(self, name))
                       for name in ("max_encoder_seq_len", "tp_size", "dp_size", "encoder_cache_num_blocks")
                       if getattr(self, name) is not None},
                    encoder_cache_min_hold_time_ms=None if hold is None else
                    _number("encoder_cache_min_hold_time_ms", hold, minimum=0.0))
        if self.num_encoder_input_buckets is not None and self.max_encoder_seq_len is not None:
            warning_once(
                logger,
                "max_encoder_seq_len=%d is ignored because num_encoder_input_buckets is set explicitly",
                self.max_encoder_seq_len,
            )

    OPTIONS = (
        "num_encoder_input_buckets", "encoder_attention_block_size", "max_encoder_seq_len",
        "tp_size", "dp_size", "encoder_cache_num_blocks", "encoder_cache_min_hold_time_ms",
    )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, namespace: str = "encoder_neuron_config") -> EncoderNeuronConfig:
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError(f"{namespace} must be an object, got {data!r}")
        values = {}
        for key, value in data.items():
            canon = _ENCODER_ALIASES.get(key, key)
            if canon in values:
                raise ValueError(f"{namespace}: {key!r} and {canon!r} name the same option; give one")
            values[canon] = value
        _check_keys(namespace, values, cls.OPTIONS, _NEURON_KEYS)
        return cls(**values)

    def parallel_sizes(self, world_size: int) -> tuple[int, int]:
        """(tp_size, dp_size) of the encoder for this world size (see the class docstring)."""
        world = _integer("world_size", world_size)
        tp, dp = self.tp_size, self.dp_size
        if tp is None and dp is None:
            return 1, world
        if tp is not None and dp is not None:
            if tp * dp != world:
                raise ValueError(
                    f"encoder_neuron_config tp_size * dp_size must equal world_size: "
                    f"tp_size={tp} * dp_size={dp} = {tp * dp} != world_size={world}"
                )
            return tp, dp
        given_name, given = ("tp_size", tp) if tp is not None else ("dp_size", dp)
        if world % given:
            raise ValueError(
                f"encoder_neuron_config {given_name}={given} must divide world_size={world} "
                "(the other degree is inferred as world_size / " + given_name + ")"
            )
        return (given, world // given) if tp is not None else (world // given, given)

    def validate(self, world_size: int) -> None:
        self.parallel_sizes(world_size)

    def min_hold_time_ms(self, epd: bool) -> float:
        """encoder_cache_min_hold_time_ms, or its auto value: 100 ms for EPD, 0 otherwise."""
        if self.encoder_cache_min_hold_time_ms is not None:
            return self.encoder_cache_min_hold_time_ms
        return EPD_MIN_HOLD_TIME_MS if epd else 0.0

    def input_buckets(self, token_ceiling: int) -> list[int]:
        """Vision encoder buckets: the explicit list, or a power-of-2 progression from
        encoder_attention_block_size up to the ceiling (capped by max_encoder_seq_len, rounded
        up to whole attention blocks, included). Audio models pass explicit block counts."""
        if self.num_encoder_input_buckets is not None:
            return list(self.num_encoder_input_buckets)
        block = self.encoder_attention_block_size
        cap = _integer("token_ceiling", token_ceiling)
        if self.max_encoder_seq_len is not None:
            cap = min(cap, self.max_encoder_seq_len)
        cap = max(block, -(-cap // block) * block)
        out, size = [], block
        while size < cap:
            out.append(size)
            size *= 2
        out.append(cap)
        return out


# The VLM onboarding guide's name for the same dataclass.
VisionNeuronConfig = EncoderNeuronConfig

_NEURON_KEYS = {k: "neuron_config" for k in NeuronConfig.OPTIONS}
_ENCODER_KEYS = {k: "encoder_neuron_config" for k in (*EncoderNeuronConfig.OPTIONS, *_ENCODER_ALIASES)}


# --- additional_config ---

@dataclass(frozen=True)
class AdditionalConfig:
    neuron_config: NeuronConfig = field(default_factory=NeuronConfig)
    encoder_neuron_config: EncoderNeuronConfig | None = None
    mm_language_model_only: bool = False


_TOP_LEVEL_KEYS = ("neuron_config", "encoder_neuron_config", "vision_neuron_config", "mm_language_model_only")


def parse_additional_config(
    value: Mapping[str, Any] | str | AdditionalConfig | None, *, mm_encoder_only: bool = False
) -> AdditionalConfig:
    """Parse --additional-config (a JSON string) or LLM(additional_config=...) (a dict).

    `mm_encoder_only` is vLLM's --mm-encoder-only flag, needed for the EPD role check.
    """
    if isinstance(value, AdditionalConfig):
        cfg = value
    else:
        value = parse_json_object(None if isinstance(value, str) and not value.strip() else value,
                                  "--additional-config is not valid JSON: {error}",
                                  "--additional-config must be a JSON object, got {value!r}")
        cfg = _parse_mapping(value)
    if mm_encoder_only and cfg.mm_language_model_only:
        raise ValueError(
            "--mm-encoder-only and mm_language_model_only are mutually exclusive: a pool is "
            "either vision-only (encoder) or language-only (prefill+decode); set at most one"
        )
    return cfg


def _parse_mapping(value: Mapping[str, Any]) -> AdditionalConfig:
    for key in value:
        if key in _TOP_LEVEL_KEYS:
            continue
        if key in VLLM_PARAMETERS:
            raise ValueError(
                f"{key!r} is a vLLM parameter, not an additional_config key; pass "
                f"{VLLM_PARAMETERS[key]} on the command line or {key}=... to LLM(...)"
            )
        if key in _NEURON_KEYS or key in _ENCODER_KEYS:
            home = _NEURON_KEYS.get(key) or _ENCODER_KEYS[key]
            raise ValueError(f"{key!r} must be nested under {home} in additional_config")
        raise ValueError(
            f"unknown additional_config key {key!r}; valid keys: {', '.join(_TOP_LEVEL_KEYS)}"
        )
    if "encoder_neuron_config" in value and "vision_neuron_config" in value:
        raise ValueError("give encoder_neuron_config or vision_neuron_config (its alias), not both")
    enc_key = "vision_neuron_config" if "vision_neuron_config" in value else "encoder_neuron_config"
    encoder = None
    if value.get(enc_key) is not None:
        encoder = EncoderNeuronConfig.from_dict(value[enc_key], namespace=enc_key)
    return AdditionalConfig(
        neuron_config=NeuronConfig.from_dict(value.get("neuron_config")),
        encoder_neuron_config=encoder,
        mm_language_model_only=V.boolean("mm_language_model_only", value.get("mm_language_model_only", False)),
    )
