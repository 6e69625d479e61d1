"""EngineConfig: every engine option, with vLLM's names, validated where it enters.

The offline `LLM(**kwargs)` and `vllm-neuron serve --flags` both build this object, so a flag and a
keyword argument mean the same thing. Options for features that are not built yet are refused with
"not supported yet" rather than ignored.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.config import buckets as B
from vllm_neuron.config.device import (DEVICE_CHOICES, DTYPE_CHOICES, async_scheduling_default,
                                       check_weight_quantization, resolve_device, resolve_dtype)
from vllm_neuron.config.generation_config import check_generation_config_arg, parse_override
from vllm_neuron.config.json_object import parse_json_object
from vllm_neuron.config.neuron_config import AdditionalConfig, NeuronConfig, parse_additional_config
from vllm_neuron.config.speculative import SpeculativeConfig, parse_speculative_config
from vllm_neuron.config.runner_selection import RunnerChoice, select_model_runner

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # fp8 = fp8_e4m3
DEFAULT_MAX_NUM_SEQS = 16
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"  # served name of the bundled model (no MODEL given)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


MM_MODALITIES = ("image", "video")


def parse_limit_mm_per_prompt(value: dict | str | None) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt ('{"image": 4, "video": 1}') -> {modality: max items}; a modality
    left out is limited by the context length only."""
    limits = _json_dict("limit_mm_per_prompt", value)
    for k, v in limits.items():
        if k not in MM_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt has unknown modality {k!r}; valid modalities: {list(MM_MODALITIES)}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"limit_mm_per_prompt[{k!r}] must be a non-negative integer, got {v!r}")
    return limits


def _json_dict(option: str, value: dict | str | None) -> dict:
    return parse_json_object(value or None, f"{option} must be a JSON object, got {{value!r}}: {{error}}",
                             f"{option} must be a JSON object, got {{value!r}}")


def _not_supported(option: str, value: Any, hint: str = "") -> ValueError:
    return ValueError(f"{option}={value!r} is not supported yet by vllm-neuron{': ' + hint if hint else ''}")


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None: the bundled SmolLM2-135M-Instruct
    tokenizer: str | None = None
    served_model_name: str | list[str] | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int | None = None  # None: the largest num_seqs_bucket, else 16
    max_num_batched_tokens: int | None = None  # None: the largest num_batched_tokens_bucket, else min(512, max_model_len)
    block_size: int = 32
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Multi-node data parallelism (vLLM's names): replicas on this node, the first one's rank (a
    # --headless node), and the head's address / port that remote replicas connect to.
    data_parallel_size_local: int | None = None  # None: every replica on this node
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    data_parallel_rank: int | None = None  # external load balancing (one server per rank): refused
    data_parallel_backend: str = "mp"
    data_parallel_hybrid_lb: bool = False
    enable_expert_parallel: bool = False
    # Multi-node tensor parallelism (vLLM's multiprocessing-backend names): nodes, this node's index, and
    # where rank 0 (node 0) listens for the process group.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    kv_cache_dtype: str = "auto"
    async_scheduling: bool | None = None
    max_logprobs: int = 20
    enable_prompt_embeds: bool = False
    speculative_config: dict | str | SpeculativeConfig | None = None  # parsed by validate_static
    kv_transfer_config: dict | str | None = None
    ec_transfer_config: dict | str | None = None
    mm_encoder_only: bool = False
    limit_mm_per_prompt: dict | str | None = None  # {"image": N, "video": M}; parsed by validate_static
    mm_processor_kwargs: dict | str | None = None  # the image processor's options, e.g. {"max_pixels": ...}
    allowed_local_media_path: str | None = None  # file:// media must lie under this folder
    chat_template: str | None = None
    trust_remote_code: bool = False  # accepted for vLLM compatibility; no remote code is ever run
    disable_log_stats: bool = False
    generation_config: str = "auto"  # auto | vllm | a folder with generation_config.json
    override_generation_config: dict | str | None = None
    additional_config: dict | str | AdditionalConfig | None = None
    # Filled by validate()
    neuron: AdditionalConfig = field(default=None, init=False, repr=False)  # type: ignore[assignment]
    runner_choice: RunnerChoice | None = field(default=None, init=False, repr=False)
    async_scheduling_reason: str = field(default="set explicitly", init=False, repr=False)
    # Engine processes sharing this engine's memory (DP replicas on one host or GPU); its KV budget
    # is that share (worker/memory.py's local_workers). Set in each replica's process.
    kv_budget_shared_by: int = field(default=1, init=False, repr=False)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {sorted(names)}")
        cfg = cls(**kwargs)
        cfg.validate_static()
        return cfg

    def validate_static(self) -> None:
        """Checks that need no model: types, ranges, features not built yet."""
        def positive(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in ("block_size", "tensor_parallel_size", "data_parallel_size", "max_logprobs"):
            positive(name)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override"):
            positive(name, allow_none=True)
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device={self.device!r} is not valid; choose one of {list(DEVICE_CHOICES)}")
        if isinstance(self.dtype, str) and self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype={self.dtype!r} is not valid; choose one of {list(DTYPE_CHOICES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size={self.block_size} is not valid; choose one of [8, 16, 32, 64, 128]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; valid values: "
                             f"{list(KV_CACHE_DTYPES)}")
        self._validate_data_parallel()
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be true, false or unset, got {self.async_scheduling!r}")
        if self.enable_prompt_embeds:
            raise _not_supported("enable_prompt_embeds", True)
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.kv_transfer_config:
            raise _not_supported("kv_transfer_config", self.kv_transfer_config)
        if self.ec_transfer_config:
            raise _not_supported("ec_transfer_config", self.ec_transfer_config,
                                 "encoder-disaggregated (EPD) inference is not supported yet")
        if self.mm_encoder_only:
            raise _not_supported("mm_encoder_only", True, "encoder-disaggregated (EPD) inference is not supported yet")
        self.limit_mm_per_prompt = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        self.mm_processor_kwargs = _json_dict("mm_processor_kwargs", self.mm_processor_kwargs)
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"allowed_local_media_path={self.allowed_local_media_path!r} is not an existing folder")
        check_generation_config_arg(self.generation_config)
        self.override_generation_config = parse_override(self.override_generation_config)
        from vllm_neuron import envs

        envs.check_supported()
        if not isinstance(self.additional_config, AdditionalConfig):
            self.additional_config = parse_additional_config(self.additional_config)
        self._validate_parallel()
        nc = self.additional_config.neuron_config
        if nc.quantization not in (None, "int8", "int4", "mxfp4"):
            # Which model honours which scheme is the model's to say (ModelSpec.quantizations).
            raise _not_supported("neuron_config.quantization", nc.quantization,
                                 "only 'int8' / 'int4' (weight-only, CPU) and 'mxfp4' (gpt-oss experts) for now")
        if nc.quantization in ("int8", "int4"):
            device = resolve_device(self.device)
            check_weight_quantization(nc.quantization, resolve_dtype(self.dtype, device), device)
        if nc.fp8_packed_kv:
            # The seeds' rule: the packed layout selects Model Runner V1, whose packed path is not built.
            raise _not_supported("neuron_config.fp8_packed_kv", True,
                                 "the packed FP8 KV layout needs Model Runner V1's packed path; kv_cache_dtype='fp8' "
                                 "gives the unpacked FP8 KV cache")
        if nc.gk_decode:
            raise _not_supported("neuron_config.gk_decode", True)
        if nc.decode_cpp_wrapper and (self.enforce_eager or envs.VLLM_NEURON_BACKEND == "eager"):
            raise ValueError("neuron_config.decode_cpp_wrapper=true needs compiled graphs; it cannot be combined "
                             "with enforce_eager or VLLM_NEURON_BACKEND=eager")
        if nc.decode_cpp_wrapper and resolve_device(self.device).type != "cpu":
            # CUDA decode steps replay captured graphs, which have no Python between calls to remove anyway.
            raise _not_supported("neuron_config.decode_cpp_wrapper", True, "it is built and tested for the CPU only")

    def _validate_parallel(self) -> None:
        """Tensor / expert parallelism and the multi-node flags; the seeds' EP rules (neuron_config.py)."""
        tp = self.tensor_parallel_size
        self.additional_config.neuron_config.validate_parallel(self.enable_expert_parallel, tp,
                                                               self.data_parallel_size, self.kv_transfer_config)
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            # The seeds' rule holds (checked above); experts shared across replicas would put them in lock-step.
            raise _not_supported("enable_expert_parallel", True, f"with data_parallel_size={self.data_parallel_size} "
                                 "(experts over the replicas); use expert parallelism within one replica")
        from vllm_neuron import envs

        workers = envs.NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS or 1
        if tp > 1 and workers > 1:
            raise _not_supported("NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS", workers,
                                 f"with tensor_parallel_size={tp} (each rank compiles its own shard's graphs; "
                                 "compile workers would have to join the ranks' process group); unset it or use 1")
        if tp > 1 and self.speculative_config is not None:
            raise _not_supported("speculative_config", self.speculative.method,
                                 f"with tensor_parallel_size={tp} (speculative decoding is not sharded yet)")
        if tp > 1 and resolve_device(self.device).type != "cpu":
            # Not built: NCCL needs one GPU per rank (since NCCL 2.5 two ranks on one GPU fail with "Duplicate GPU
            # detected"), and the one-GPU machines this is tested on could never run it.
            raise _not_supported("tensor_parallel_size", tp, "tensor parallelism runs on CPU (gloo) only; on CUDA "
                                 "it needs NCCL with one GPU per rank (NCCL does not run two ranks on one GPU), "
                                 "which is not built; use --device cpu, or --data-parallel-size to use several GPUs")
        if not isinstance(self.nnodes, int) or isinstance(self.nnodes, bool) or self.nnodes < 1 or tp % self.nnodes:
            raise ValueError(f"nnodes must be a positive integer that divides tensor_parallel_size={tp} (each node "
                             f"runs tensor_parallel_size / nnodes ranks), got {self.nnodes!r}")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            # Every replica's group would meet at the one --master-addr:--master-port.
            raise _not_supported("nnodes", self.nnodes, f"with data_parallel_size={self.data_parallel_size}: each "
                                 "replica's tensor-parallel ranks run on its own node; spread replicas over nodes "
                                 "with --data-parallel-size-local and --headless")
        if not isinstance(self.node_rank, int) or isinstance(self.node_rank, bool) or \
                not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be an integer in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        port = self.master_port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"master_port must be a TCP port in [1, 65535], got {port!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr must be a host name or IP address, got {self.master_addr!r}")

    @property
    def local_tp_ranks(self) -> int:
        """Tensor-parallel ranks on this node."""
        return self.tensor_parallel_size // self.nnodes

    def _validate_data_parallel(self) -> None:
        dp = self.data_parallel_size
        if self.data_parallel_rank is not None:
            raise _not_supported("data_parallel_rank", self.data_parallel_rank,
                                 "external load balancing (one server per rank); use --data-parallel-size with "
                                 "--data-parallel-size-local / --headless for replicas behind one API server")
        if self.data_parallel_backend != "mp":
            raise _not_supported("data_parallel_backend", self.data_parallel_backend, "only 'mp' (multiprocessing)")
        if self.data_parallel_hybrid_lb:
            raise _not_supported("data_parallel_hybrid_lb", True, "replicas on every node join the head's router")
        local = self.data_parallel_size_local
        if local is not None and (not isinstance(local, int) or isinstance(local, bool) or not 0 <= local <= dp):
            raise ValueError(f"data_parallel_size_local must be an integer in [0, data_parallel_size={dp}], "
                             f"got {local!r}")
        start = self.data_parallel_start_rank
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < dp:
            raise ValueError(f"data_parallel_start_rank must be an integer in [0, data_parallel_size={dp}), "
                             f"got {start!r}")
        if start + self.local_dp_replicas > dp:
            raise ValueError(f"data_parallel_start_rank={start} + data_parallel_size_local={self.local_dp_replicas} "
                             f"exceeds data_parallel_size={dp}")
        port = self.data_parallel_rpc_port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"data_parallel_rpc_port must be a TCP port in [1, 65535], got {port!r}")
        if not isinstance(self.data_parallel_address, str) or not self.data_parallel_address:
            raise ValueError(f"data_parallel_address must be a host name or IP address, got "
                             f"{self.data_parallel_address!r}")

    @property
    def local_dp_replicas(self) -> int:
        """Data-parallel replicas this node runs."""
        local = self.data_parallel_size_local
        return self.data_parallel_size if local is None else local

    @property
    def multi_node_dp(self) -> bool:
        """Some replicas run on other nodes: the head listens on data_parallel_address:rpc_port."""
        return self.local_dp_replicas < self.data_parallel_size

    def finalize(self, model_max_len: int, *, moe: bool = False, sliding_window: bool = False,
                 multimodal: bool = False) -> NeuronConfig:
        """Fills the model-dependent defaults and resolves the bucket lists; `moe` / `sliding_window` /
        `multimodal` describe the model (they select MRv1 by default)."""
        if not multimodal:
            for option in ("limit_mm_per_prompt", "mm_processor_kwargs"):
                if getattr(self, option):
                    raise ValueError(f"{option} applies to multimodal models only; this model takes text only")
            if self.additional_config.mm_language_model_only:
                raise ValueError("mm_language_model_only applies to multimodal models only; this model is text only")
            if self.additional_config.encoder_neuron_config is not None:
                raise ValueError("encoder_neuron_config applies to multimodal models only; this model is text only")
        enc = self.additional_config.encoder_neuron_config
        if enc is not None:
            if enc.parallel_sizes(self.tensor_parallel_size) != (1, 1):
                raise _not_supported("encoder_neuron_config tp_size/dp_size", (enc.tp_size, enc.dp_size),
                                     "the encoder runs on one device")
            if enc.encoder_cache_min_hold_time_ms:
                raise _not_supported("encoder_neuron_config.encoder_cache_min_hold_time_ms",
                                     enc.encoder_cache_min_hold_time_ms, "it guards EPD transfers, which are not built")
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's maximum context "
                f"({model_max_len}, max_position_embeddings)")
        user_nc = self.additional_config.neuron_config
        if self.max_num_batched_tokens is None:
            # Bucket lists given without the max: the largest bucket is the max (seeds' rule read backwards).
            given = user_nc.num_batched_tokens_buckets or user_nc.kv_segment_size_buckets
            self.max_num_batched_tokens = max(given) if given else min(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                                       self.max_model_len)
        if self.max_num_seqs is None:
            self.max_num_seqs = max(user_nc.num_seqs_buckets) if user_nc.num_seqs_buckets else DEFAULT_MAX_NUM_SEQS
        on_cpu = resolve_device(self.device).type == "cpu"
        nc = self.additional_config.neuron_config.resolved(
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len, block_size=self.block_size,
            enable_expert_parallel=self.enable_expert_parallel,
            tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
            kv_transfer_config=self.kv_transfer_config,
            # On CPU a decode step streams every weight whatever the batch, so padding a batch up to the
            # next bucket is cheap, while every bucket is a graph to compile and load at start-up. A
            # prefill step is compute-bound there instead, and costs its padded tokens: short prompts
            # and prefix-cache suffixes get buckets of 32 and 64 (P3 warm TTFT 414 -> 308 ms).
            decode_bucket_factor=4 if on_cpu else 2,
            prefill_bucket_start=32 if on_cpu else B.MIN_DEFAULT_PREFILL_BUCKET)
        if self.max_model_len % self.block_size:
            # Context buckets are whole blocks; the largest one is max_model_len.
            raise ValueError(f"max_model_len={self.max_model_len} must be a multiple of block_size={self.block_size}")
        self.additional_config = dataclasses.replace(self.additional_config, neuron_config=nc)
        spec = self.speculative_config
        if spec is not None and nc.on_device_sampling_config is None:
            raise ValueError("speculative decoding requires on-device sampling (the rejection sampler runs in the "
                             "graph), but neuron_config.on_device_sampling_config is null; enable on-device "
                             "sampling or remove --speculative-config")
        if spec is not None:
            if self.async_scheduling:
                raise ValueError("async_scheduling=True is not supported with speculative decoding yet (each "
                                 "step's drafts need the previous step's tokens on the host); use "
                                 "--no-async-scheduling")
            self.async_scheduling, self.async_scheduling_reason = False, \
                "off: speculative decoding (drafts are proposed from each step's tokens on the host)"
        elif nc.on_device_sampling_config is None:
            if self.async_scheduling:
                raise ValueError(
                    "async_scheduling=True requires on-device sampling, but neuron_config.on_device_sampling_config "
                    "is null (CPU sampling); use --no-async-scheduling or enable on-device sampling")
            self.async_scheduling, self.async_scheduling_reason = False, "off: CPU sampling (needs on-device sampling)"
        elif self.async_scheduling is None:
            self.async_scheduling, self.async_scheduling_reason = async_scheduling_default(resolve_device(self.device))
        from vllm_neuron import envs

        self.runner_choice = select_model_runner(envs.VLLM_USE_V2_MODEL_RUNNER,
                                                 cpu_sampling=nc.on_device_sampling_config is None,
                                                 enforce_eager=self.enforce_eager,
                                                 speculative=spec is not None, moe=moe or multimodal,
                                                 sliding_window=sliding_window)
        if spec is not None and self.runner_choice.use_v2:
            raise ValueError("VLLM_USE_V2_MODEL_RUNNER=1 cannot serve speculative decoding: Neuron Model Runner V2 "
                             "does not support it; unset VLLM_USE_V2_MODEL_RUNNER (MRv1 is then selected)")
        return nc

    @property
    def use_v2_model_runner(self) -> bool:
        """The resolved runner (seeds: `VllmConfig.use_v2_model_runner`); set by finalize()."""
        return self.runner_choice is not None and self.runner_choice.use_v2

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config (None: no speculation)."""
        return self.speculative_config  # type: ignore[return-value]

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def neuron_config(self) -> NeuronConfig:
        return self.additional_config.neuron_config

    def served_names(self) -> list[str]:
        if self.served_model_name is None:
            return [self.model or BUNDLED_MODEL_NAME]
        if isinstance(self.served_model_name, str):
            return [self.served_model_name]
        return list(self.served_model_name)

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return json.dumps(d, default=str)
