"""The engine's options as the user gave them (`EngineArgs`), and every check that needs no model.

The offline `LLM(**kwargs)` and `vllm-neuron serve --flags` both build `EngineArgs`, so a flag and a
keyword argument mean the same thing. Options for features that are not built yet are refused with
"not supported yet" rather than ignored. `config/engine_config.py` resolves them, with the model's facts,
into the frozen `EngineConfig` the engine runs on.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from vllm_neuron import envs
from vllm_neuron.config import compatibility
from vllm_neuron.config import validate as V
from vllm_neuron.config.device import (DEVICE_CHOICES, DTYPE_CHOICES, check_weight_quantization, resolve_device,
                                       resolve_model_dtype)
from vllm_neuron.config import grammar_limits as GL
from vllm_neuron.config.generation_config import check_generation_config_arg, parse_override
from vllm_neuron.config.json_object import parse_json_object
from vllm_neuron.config.kv_offload import KVOffloadConfig, parse_kv_offloading
from vllm_neuron.config.ec_transfer import ECTransferConfig, parse_ec_transfer_config
from vllm_neuron.config.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from vllm_neuron.config.lora import LoRAConfig, LoRAModulePath, check_lora_options
from vllm_neuron.config.neuron_config import AdditionalConfig, parse_additional_config
from vllm_neuron.config.pooler_config import CONVERTS, RUNNERS, TASKS, PoolerConfig, parse_pooler_config
from vllm_neuron.config.speculative import SpeculativeConfig, parse_speculative_config
from vllm_neuron.logits_processor import load_logits_processor

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # fp8 = fp8_e4m3
BLOCK_SIZES = (8, 16, 32, 64, 128)
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"  # served name of the bundled model (no MODEL given)
MM_MODALITIES = ("image", "video", "audio")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy values
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*\.?")


def parse_limit_mm_per_prompt(value: dict | str | None) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt ('{"image": 4, "video": 1}') -> {modality: max items}; a modality
    left out is limited by the context length only."""
    limits = _json_dict("limit_mm_per_prompt", value)
    for k, v in limits.items():
        V.choice("limit_mm_per_prompt modality", k, MM_MODALITIES)
        V.integer(f"limit_mm_per_prompt[{k!r}]", v, minimum=0)
    return limits


def check_allowed_media_domains(value: object) -> None:
    """None, or a list of host names / IP addresses (no scheme, path or port)."""
    if value is None:
        return
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(d, str) for d in value):
        raise ValueError(f"allowed_media_domains must be a list of host names, got {value!r}")
    for domain in value:
        try:
            ipaddress.ip_address(domain.strip("[]"))
            continue
        except ValueError:
            pass
        if not _HOST_NAME.fullmatch(domain):
            raise ValueError(f"allowed_media_domains: {domain!r} is not a host name or IP address (give hosts "
                             "only, e.g. upload.wikimedia.org or 10.0.0.5, without scheme, port or path)")


def _json_dict(option: str, value: dict | str | None) -> dict:
    return parse_json_object(value or None, f"{option} must be a JSON object, got {{value!r}}: {{error}}",
                             f"{option} must be a JSON object, got {{value!r}}")


# vLLM's --logprobs-mode values: what a request's logprobs are taken from (worker/host_sampler.py).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class EngineOptions:
    """Every engine option, with vLLM's names and defaults: what EngineArgs (as given) and EngineConfig
    (resolved) both carry."""

    model: str | None = None  # HF directory, .gguf file or Hugging Face id; None: the bundled SmolLM2-135M-Instruct
    tokenizer: str | None = None
    # Models by Hugging Face id (model/loader/hub.py): the branch / tag / commit, the tokenizer's, the cache folder
    # (None: huggingface_hub's), and the one GGUF file of a GGUF repository (llama.cpp's --hf-file).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    hf_file: str | None = None
    served_model_name: str | list[str] | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int | None = None  # None: the largest num_seqs_bucket, else 16
    max_num_batched_tokens: int | None = None  # None: the largest num_batched_tokens_bucket, else min(512, max_model_len)
    # Engine requests admitted and unfinished (running + waiting) beyond which the server answers 503
    # (vLLM's name); None: 16 x max_num_seqs x data_parallel_size; 0: no bound.
    max_num_queued_reqs: int | None = None
    # fcfs: arrival order; priority: a request's `priority` (lower first), then arrival (core/scheduler.py).
    scheduling_policy: str = "fcfs"
    block_size: int = 32
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    device: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of consecutive layers (distributed/pipeline.py), each tp ranks
    decode_context_parallel_size: int = 1  # vLLM's; only 1 is built (_check_parallel says why)
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
    max_logprobs: int = 20  # -1: the whole vocabulary
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES
    # Custom logits processors: 'package.module:Class' strings or classes (vllm_neuron/logits_processor.py).
    logits_processors: list | None = None
    enable_prompt_embeds: bool = False
    # Pooling models (config/pooler_config.py): vLLM's --runner / --convert, the older --task, --pooler-config.
    runner: str = "auto"  # auto | generate | pooling
    convert: str = "auto"  # auto | none | embed | classify
    task: str | None = None  # the older spelling: generate | embed | embedding | classify | score
    pooler_config: dict | str | PoolerConfig | None = None  # {"pooling_type", "normalize", "dimensions", ...}
    speculative_config: dict | str | SpeculativeConfig | None = None
    # LoRA adapters (config/lora.py): adapters resident on the device (slots in one batch), their largest rank,
    # adapters kept in host memory (None: max_loras), and the server's adapters registered at start.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list | tuple | None = None  # "name=path" strings, JSON objects or LoRAModulePath
    kv_transfer_config: dict | str | KVTransferConfig | None = None  # config/kv_transfer.py
    # A second KV tier (config/kv_offload.py): its size in GiB and vLLM's backend name; `kv_offload` is what
    # check() resolves them to, with the folder of VLLM_NEURON_KV_OFFLOAD_DIR.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    kv_offload: KVOffloadConfig | None = None
    ec_transfer_config: dict | str | ECTransferConfig | None = None  # config/ec_transfer.py
    mm_encoder_only: bool = False
    limit_mm_per_prompt: dict | str | None = None  # {"image": N, "video": M}
    mm_processor_kwargs: dict | str | None = None  # the image processor's options, e.g. {"max_pixels": ...}
    allowed_local_media_path: str | None = None  # file:// media must lie under this folder
    # http(s) media hosts (vLLM's --allowed-media-domains); None: any public host. Loopback, link-local and
    # private addresses are refused unless their host is listed here.
    allowed_media_domains: list[str] | None = None
    chat_template: str | None = None
    trust_remote_code: bool = False  # accepted for vLLM compatibility; no remote code is ever run
    disable_log_stats: bool = False
    generation_config: str = "auto"  # auto | vllm | a folder with generation_config.json
    override_generation_config: dict | str | None = None
    additional_config: dict | str | AdditionalConfig | None = None
    # Structured outputs: how much grammar work one request may ask for (config/grammar_limits.py).
    grammar_max_properties: int = GL.DEFAULT_MAX_PROPERTIES
    grammar_max_depth: int = GL.DEFAULT_MAX_DEPTH
    grammar_max_pattern_length: int = GL.DEFAULT_MAX_PATTERN_LENGTH
    grammar_max_repeat: int = GL.DEFAULT_MAX_REPEAT
    grammar_max_bytes: int = GL.DEFAULT_MAX_BYTES
    grammar_compile_timeout: float = GL.DEFAULT_COMPILE_TIMEOUT_S
    grammar_cache_bytes: int = GL.DEFAULT_CACHE_BYTES

    @property
    def grammar_limits(self) -> GL.GrammarLimits:
        return GL.GrammarLimits(self.grammar_max_properties, self.grammar_max_depth, self.grammar_max_pattern_length,
                                self.grammar_max_repeat, self.grammar_max_bytes, self.grammar_compile_timeout,
                                self.grammar_cache_bytes)

    @property
    def lora(self) -> LoRAConfig | None:
        """The LoRA limits (None: LoRA off)."""
        return check_lora_options(self.enable_lora, self.lora_modules, self.max_loras, self.max_lora_rank,
                                  self.max_cpu_loras)[0]

    @property
    def lora_module_paths(self) -> tuple[LoRAModulePath, ...]:
        return check_lora_options(self.enable_lora, self.lora_modules, self.max_loras, self.max_lora_rank,
                                  self.max_cpu_loras)[1]

    @property
    def world_size(self) -> int:
        """Ranks of one engine: tensor_parallel_size x pipeline_parallel_size (one process each)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_tp_ranks(self) -> int:
        """Ranks (tensor x pipeline parallel) on this node."""
        return self.world_size // self.nnodes

    @property
    def local_dp_replicas(self) -> int:
        """Data-parallel replicas this node runs."""
        local = self.data_parallel_size_local
        return self.data_parallel_size if local is None else local

    @property
    def multi_node_dp(self) -> bool:
        """Some replicas run on other nodes: the head listens on data_parallel_address:rpc_port."""
        return self.local_dp_replicas < self.data_parallel_size

    def served_names(self) -> list[str]:
        if self.served_model_name is None:
            return [self.model or BUNDLED_MODEL_NAME]
        if isinstance(self.served_model_name, str):
            return [self.served_model_name]
        return list(self.served_model_name)


_BOOLEANS = ("enable_prefix_caching", "enforce_eager", "data_parallel_hybrid_lb", "enable_expert_parallel",
             "enable_prompt_embeds", "mm_encoder_only", "trust_remote_code", "disable_log_stats")


@dataclass(frozen=True)
class EngineArgs(EngineOptions):
    """The options as given. `from_kwargs` refuses unknown names and bad values at once; `checked` returns
    a copy whose JSON options (speculative_config, additional_config, ...) are parsed."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = option_names()
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**kwargs).checked()

    def checked(self, device: torch.device | None = None) -> EngineArgs:
        """Every check that needs no model (types, ranges, combinations, features not built yet), on the
        resolved `device` (resolved here when not given); returns the copy with its JSON options parsed."""
        V.choice("device", self.device, DEVICE_CHOICES)
        if not isinstance(self.dtype, torch.dtype):
            V.choice("dtype", self.dtype, DTYPE_CHOICES)
        device = resolve_device(self.device) if device is None else device
        self._check_numbers()
        V.choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        V.choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        V.choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        V.choice("runner", self.runner, RUNNERS)
        V.choice("convert", self.convert, CONVERTS)
        if self.task is not None:
            V.choice("task", self.task, tuple(TASKS))
        if self.logits_processors is not None:
            if isinstance(self.logits_processors, (str, type)) or not isinstance(self.logits_processors, (list, tuple)):
                raise ValueError(f"logits_processors must be a list of 'package.module:Class' names or classes, got "
                                 f"{self.logits_processors!r}")
            for spec in self.logits_processors:
                load_logits_processor(spec)  # a start-up error naming the entry, before any engine starts
        V.boolean("async_scheduling", self.async_scheduling, allow_none=True)
        self._check_data_parallel()
        ec = parse_ec_transfer_config(self.ec_transfer_config)
        if self.mm_encoder_only and (ec is None or not ec.is_producer):
            raise ValueError("mm_encoder_only (an EPD encoder instance) needs --ec-transfer-config with ec_role "
                             "'ec_producer' or 'ec_both': its embeddings must go somewhere")
        if self.mm_encoder_only:
            self._check_encoder_only()
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"allowed_local_media_path={self.allowed_local_media_path!r} is not an existing folder")
        check_allowed_media_domains(self.allowed_media_domains)
        _, lora_modules = check_lora_options(self.enable_lora, self.lora_modules, self.max_loras,
                                             self.max_lora_rank, self.max_cpu_loras)
        for name in ("revision", "tokenizer_revision", "download_dir", "hf_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        check_generation_config_arg(self.generation_config)
        envs.check_supported()
        parsed = dataclasses.replace(
            self, speculative_config=parse_speculative_config(self.speculative_config),
            kv_transfer_config=parse_kv_transfer_config(self.kv_transfer_config), ec_transfer_config=ec,
            kv_offload=parse_kv_offloading(self.kv_offloading_size, self.kv_offloading_backend,
                                           envs.VLLM_NEURON_KV_OFFLOAD_DIR),
            limit_mm_per_prompt=parse_limit_mm_per_prompt(self.limit_mm_per_prompt),
            mm_processor_kwargs=_json_dict("mm_processor_kwargs", self.mm_processor_kwargs),
            override_generation_config=parse_override(self.override_generation_config),
            pooler_config=parse_pooler_config(self.pooler_config), lora_modules=list(lora_modules) or None,
            additional_config=parse_additional_config(self.additional_config,
                                                        mm_encoder_only=self.mm_encoder_only))
        if parsed.additional_config.mm_language_model_only and ec is not None and ec.is_producer:
            raise ValueError(f"ec_transfer_config.ec_role {ec.ec_role!r}: mm_language_model_only builds no vision "
                             "tower, so this instance has no embeddings to produce; use 'ec_consumer'")
        parsed._check_parallel()
        parsed._check_neuron_config(device)
        compatibility.check(parsed.features(device))
        return parsed

    def _check_encoder_only(self) -> None:
        """An EPD encoder instance runs the vision tower in one process: options for the language model or for
        several processes are refused, not ignored."""
        scale = "run more encoder instances behind `vllm-neuron epd-proxy` instead"
        refused = {"tensor_parallel_size": (self.tensor_parallel_size if self.tensor_parallel_size != 1 else None,
                                            scale),
                   "data_parallel_size": (self.data_parallel_size if self.data_parallel_size != 1 else None, scale),
                   "speculative_config": (self.speculative_config, "an encoder instance generates no text"),
                   "kv_transfer_config": (self.kv_transfer_config, "an encoder instance holds no KV cache"),
                   "enable_lora": (self.enable_lora or None, "an encoder instance has no language model"),
                   "enable_prompt_embeds": (self.enable_prompt_embeds or None, "an encoder instance has no language "
                                                                               "model")}
        for option, (value, why) in refused.items():
            if value:
                raise ValueError(f"{option}={value!r} does not apply to an EPD encoder instance (mm_encoder_only): "
                                 f"{why}")

    def features(self, device: torch.device, **model: bool) -> compatibility.Features:
        """What this (checked) configuration uses, for config/compatibility.py; `model`: the model's facts."""
        nc = self.additional_config.neuron_config
        return compatibility.Features(
            **model, device=device.type,
            speculative=self.speculative_config.method if self.speculative_config else None,
            cpu_sampling=nc.on_device_sampling_config is None, enforce_eager=self.enforce_eager,
            eager_backend=self.enforce_eager or envs.VLLM_NEURON_BACKEND == "eager",
            async_scheduling=self.async_scheduling, tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size, nnodes=self.nnodes,
            expert_parallel=self.enable_expert_parallel, decode_cpp_wrapper=nc.decode_cpp_wrapper,
            kv_transfer=self.kv_transfer_config is not None, kv_offload=self.kv_offloading_size is not None,
            compile_workers=envs.NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS or 1,
            prompt_embeds=self.enable_prompt_embeds, lora=self.enable_lora,
            prefix_caching=bool(self.enable_prefix_caching))

    def _check_numbers(self) -> None:
        V.choice("block_size", self.block_size, BLOCK_SIZES)
        for name in ("tensor_parallel_size", "data_parallel_size"):
            V.integer(name, getattr(self, name), minimum=1)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override"):
            V.optional_integer(name, getattr(self, name), minimum=1)
        V.optional_integer("max_num_queued_reqs", self.max_num_queued_reqs, minimum=0, context="0: no bound")
        if self.max_logprobs != -1:
            V.integer("max_logprobs", self.max_logprobs, minimum=0, context="or -1: the whole vocabulary")
        V.integer("seed", self.seed)
        V.number("gpu_memory_utilization", self.gpu_memory_utilization, minimum=0.0, maximum=1.0,
                 min_exclusive=True)
        for name in _BOOLEANS:
            V.boolean(name, getattr(self, name))
        self.grammar_limits.check()

    def _check_data_parallel(self) -> None:
        dp = self.data_parallel_size
        if self.data_parallel_rank is not None:
            raise V.not_supported("data_parallel_rank", self.data_parallel_rank,
                                  "external load balancing (one server per rank); use --data-parallel-size with "
                                  "--data-parallel-size-local / --headless for replicas behind one API server")
        if self.data_parallel_backend != "mp":
            raise V.not_supported("data_parallel_backend", self.data_parallel_backend, "only 'mp' (multiprocessing)")
        if self.data_parallel_hybrid_lb:
            raise V.not_supported("data_parallel_hybrid_lb", True, "replicas on every node join the head's router")
        V.optional_integer("data_parallel_size_local", self.data_parallel_size_local, minimum=0, maximum=dp,
                           context=f"data_parallel_size={dp}")
        start = V.integer("data_parallel_start_rank", self.data_parallel_start_rank, minimum=0, maximum=dp - 1,
                          context=f"data_parallel_size={dp}")
        if start + self.local_dp_replicas > dp:
            raise ValueError(f"data_parallel_start_rank={start} + data_parallel_size_local={self.local_dp_replicas} "
                             f"exceeds data_parallel_size={dp}")
        V.port("data_parallel_rpc_port", self.data_parallel_rpc_port)
        V.host("data_parallel_address", self.data_parallel_address)

    def _check_parallel(self) -> None:
        """Tensor / expert parallelism and the multi-node flags (the seeds' EP rules: neuron_config.py)."""
        tp = self.tensor_parallel_size
        V.integer("pipeline_parallel_size", self.pipeline_parallel_size, minimum=1)
        if V.integer("decode_context_parallel_size", self.decode_context_parallel_size, minimum=1) > 1:
            raise V.not_supported(
                "decode_context_parallel_size", self.decode_context_parallel_size,
                "splitting a sequence's KV over the tensor-parallel ranks adds a log-sum-exp merge (one collective) "
                "per layer to every decode step, and a gloo collective between CPU ranks costs about 1 ms "
                "(docs/benchmarks.md, tensor parallelism: 61 of them were 62% of a 98.5 ms decode step), more than "
                "the attention it would halve (a SmolLM2-135M step reads ~6 MB of KV per layer at 8k tokens, "
                "~0.3 ms); use one rank per sequence (--data-parallel-size) for long contexts")
        self.additional_config.neuron_config.validate_parallel(self.enable_expert_parallel, tp,
                                                               self.data_parallel_size)
        world = self.world_size
        if not isinstance(self.nnodes, int) or isinstance(self.nnodes, bool) or self.nnodes < 1 or world % self.nnodes:
            raise ValueError(f"nnodes must be a positive integer that divides tensor_parallel_size={tp} x "
                             f"pipeline_parallel_size={self.pipeline_parallel_size} = {world} ranks (each node runs "
                             f"world / nnodes of them), got {self.nnodes!r}")
        V.integer("node_rank", self.node_rank, minimum=0, maximum=self.nnodes - 1, context=f"nnodes={self.nnodes}")
        V.port("master_port", self.master_port)
        V.host("master_addr", self.master_addr)

    def _check_neuron_config(self, device: torch.device) -> None:
        nc = self.additional_config.neuron_config
        dtype, _ = resolve_model_dtype(self.dtype, device, nc.quantization)
        if nc.quantization in ("int8", "int4"):
            check_weight_quantization(nc.quantization, dtype, device)
        if nc.fp8_packed_kv:
            # The seeds' rule: the packed layout selects Model Runner V1, whose packed path is not built.
            raise V.not_supported("neuron_config.fp8_packed_kv", True,
                                  "the packed FP8 KV layout needs Model Runner V1's packed path; kv_cache_dtype='fp8' "
                                  "gives the unpacked FP8 KV cache")
        if nc.gk_decode:
            raise V.not_supported("neuron_config.gk_decode", True)


def option_names() -> set[str]:
    """Every engine option (LLM keyword / CLI flag destination)."""
    return {f.name for f in dataclasses.fields(EngineOptions)}
