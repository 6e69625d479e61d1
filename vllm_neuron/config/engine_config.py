"""EngineConfig: the engine's options resolved once, with the model's facts, into one frozen object.

`resolve(args, facts)` runs in the process that received the user's options (the API server for `serve`,
the `LLM` process offline, a `serve --headless` node for its replicas), with the facts read from the
model's config (HF config.json or GGUF metadata; no weights: engine/resolve.py reads them). The result is
sent whole to the engine core processes, tensor-parallel ranks, compile workers and data-parallel
replicas, which never resolve again. Nothing can change it afterwards: setting any attribute raises
FrozenInstanceError naming it (the nested neuron_config / on_device_sampling_config are frozen too).

Resolved here: the device and dtype (with the reason logged at start-up), the backend, the runner
(config/compatibility.py), max_model_len / max_num_seqs / max_num_batched_tokens / max_num_queued_reqs and
the bucket lists,
async scheduling (and why), and each data-parallel replica's share of its host's memory.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vllm_neuron import envs
from vllm_neuron.config import buckets as B
from vllm_neuron.config import validate as V
from vllm_neuron.config.compatibility import RunnerChoice, select_runner
from vllm_neuron.config.device import (BF16_WEIGHTS, async_scheduling_default, replicas_sharing_memory,
                                       resolve_device, resolve_model_dtype)
from vllm_neuron.config.engine_args import EngineArgs, EngineOptions
from vllm_neuron.config.kv_transfer import KVTransferConfig
from vllm_neuron.config.neuron_config import AdditionalConfig, NeuronConfig
from vllm_neuron.config.pooler_config import PoolingSetup
from vllm_neuron.config.speculative import SpeculativeConfig
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# max_num_queued_reqs left unset: this many full batches per replica may run or wait (a client that waits
# behind 15 full batches still gets its answer; one past them gets a 503 at once).
DEFAULT_QUEUED_BATCHES = 16


@dataclass(frozen=True)
class ModelFacts:
    """What resolution needs to know about the model, read from its config without loading weights."""

    max_model_len: int  # the model's maximum context (max_position_embeddings)
    moe: bool = False
    sliding_window: bool = False
    multimodal: bool = False
    audio: bool = False
    # A pooling engine's pooler (config/pooler_config.py; engine/resolve.py reads the checkpoint's files); None
    # for a generative one.
    pooling: PoolingSetup | None = None


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineOptions):
    """Every option resolved; built only by `resolve`. Fields keep their vLLM names, with resolved values."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_num_queued_reqs: int  # 0: no bound
    device: str  # "cpu" or "cuda" (torch_device)
    dtype: str  # "bfloat16", "float32" or "float16" (torch_dtype)
    # This replica's share of its device's memory: the user's value divided among the replicas sharing a GPU.
    gpu_memory_utilization: float
    async_scheduling: bool
    speculative_config: SpeculativeConfig | None
    additional_config: AdditionalConfig  # neuron_config with its bucket lists filled in
    limit_mm_per_prompt: dict[str, int]
    mm_processor_kwargs: dict
    override_generation_config: dict
    # Resolved facts that have no option of their own
    model_facts: ModelFacts
    dtype_reason: str  # why this dtype (the start-up log: "dtype bfloat16 (auto: ...)")
    backend: str  # "native" (compiled graphs) or "eager" (enforce_eager or VLLM_NEURON_BACKEND=eager)
    runner_choice: RunnerChoice
    async_scheduling_reason: str
    # Engine processes sharing this engine's memory (DP replicas on one host or GPU); its KV budget is that
    # share (worker/memory.py's local_workers).
    kv_budget_shared_by: int
    # A pooling engine (--runner pooling): prefill-only steps, pooled outputs; None: a generative engine.
    pooling: PoolingSetup | None = None
    # Pipeline parallelism: the micro-batches of a decode step (VLLM_NEURON_PP_MICRO_BATCHES; 1: one piece).
    pp_micro_batches: int = 1

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def use_v2_model_runner(self) -> bool:
        """The resolved runner (seeds: `VllmConfig.use_v2_model_runner`)."""
        return self.runner_choice.use_v2

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """The parsed kv_transfer_config (None: not a disaggregated instance)."""
        return self.kv_transfer_config

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config (None: no speculation)."""
        return self.speculative_config

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def neuron_config(self) -> NeuronConfig:
        return self.additional_config.neuron_config


def resolve(args: EngineArgs, facts: ModelFacts) -> EngineConfig:
    """`args` checked and resolved for a model with `facts` (see the module docstring)."""
    device = resolve_device(args.device)
    args = args.checked(device)
    # Which runner, and the combinations refused with this model, before the options that depend on them.
    runner_choice = select_runner(args.features(device, moe=facts.moe, sliding_window=facts.sliding_window,
                                                multimodal=facts.multimodal, audio=facts.audio), envs.VLLM_USE_V2_MODEL_RUNNER)
    _check_model_options(args, facts)
    if facts.pooling is not None:
        args = _pooling_options(args)
    args = _tensor_debug_options(args, facts)
    max_model_len, max_num_batched_tokens, max_num_seqs = _limits(args, facts)
    if facts.pooling is not None and facts.pooling.bidirectional and max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be at least max_model_len="
                         f"{max_model_len} for a bidirectional encoder: each prompt runs whole in one step (it "
                         "has no KV cache to continue from); raise it or lower max_model_len")
    user_nc = args.additional_config.neuron_config
    on_cpu = device.type == "cpu"
    nc = user_nc.resolved(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        block_size=args.block_size, enable_expert_parallel=args.enable_expert_parallel,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        # On CPU a decode step streams every weight whatever the batch, so padding a batch up to the
        # next bucket is cheap, while every bucket is a graph to compile and load at start-up. A
        # prefill step is compute-bound there instead, and costs its padded tokens: short prompts
        # and prefix-cache suffixes get buckets of 32 and 64 (P3 warm TTFT 414 -> 308 ms).
        decode_bucket_factor=4 if on_cpu else 2,
        prefill_bucket_start=32 if on_cpu else B.MIN_DEFAULT_PREFILL_BUCKET)
    if max_model_len % args.block_size:
        # Context buckets are whole blocks; the largest one is max_model_len.
        raise ValueError(f"max_model_len={max_model_len} must be a multiple of block_size={args.block_size}")
    dtype, dtype_reason = resolve_model_dtype(args.dtype, device, nc.quantization)
    if nc.quantization == BF16_WEIGHTS:
        nc = dataclasses.replace(nc, quantization=None)  # the dtype carries it: nothing is quantized
    async_on, async_reason = _async_scheduling(args, nc, device)
    shared_by, gmu = _memory_share(args, device)
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineOptions)}
    return EngineConfig(**{
        **options, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens, "device": device.type,
        "max_num_queued_reqs": (DEFAULT_QUEUED_BATCHES * max_num_seqs * args.data_parallel_size
                                if args.max_num_queued_reqs is None else args.max_num_queued_reqs),
        "dtype": str(dtype).removeprefix("torch."), "gpu_memory_utilization": gmu, "async_scheduling": async_on,
        "additional_config": dataclasses.replace(args.additional_config, neuron_config=nc),
        "model_facts": facts, "dtype_reason": dtype_reason,
        "backend": "eager" if args.enforce_eager else envs.VLLM_NEURON_BACKEND,
        "runner_choice": runner_choice, "async_scheduling_reason": async_reason, "kv_budget_shared_by": shared_by,
        "pooling": facts.pooling,
        "pp_micro_batches": envs.VLLM_NEURON_PP_MICRO_BATCHES})


def _pooling_options(args: EngineArgs) -> EngineArgs:
    """A pooling engine's refusals, and prefix caching off: a pooled request's output needs every prompt
    position computed by its own step (a mean over cached blocks would read K/V, not hidden states)."""
    refused = {"speculative_config": args.speculative_config, "kv_transfer_config": args.kv_transfer_config,
               "kv_offloading_size": args.kv_offloading_size,
               "enable_prompt_embeds": args.enable_prompt_embeds or None, "enable_lora": args.enable_lora or None,
               "tensor_parallel_size": args.tensor_parallel_size if args.tensor_parallel_size > 1 else None,
               "pipeline_parallel_size": args.pipeline_parallel_size if args.pipeline_parallel_size > 1 else None}
    for option, value in refused.items():
        if value is not None:
            raise V.not_supported(option, value, "a pooling model (--runner pooling) runs without it")
    return dataclasses.replace(args, enable_prefix_caching=False)


def _tensor_debug_options(args: EngineArgs, facts: ModelFacts) -> EngineArgs:
    """Tensor capture / replacement (config/tensor_debug.py): refused for pooling models; replacement turns
    prefix caching off, since a replaced module's output changes what the KV cache holds and those blocks must
    never serve another request."""
    nc = args.additional_config.neuron_config
    if nc.tensor_capture is None and nc.tensor_replacement is None:
        return args
    if facts.pooling is not None:
        raise V.not_supported("neuron_config.tensor_capture / tensor_replacement", "set",
                              "pooling models' graphs return hidden states only")
    if nc.tensor_replacement is not None and args.kv_offload is not None:
        raise V.not_supported("kv_offloading_size", args.kv_offloading_size, "with neuron_config.tensor_replacement "
                              "(replaced outputs change what the KV cache holds; the tier would keep them)")
    if nc.tensor_replacement is not None and args.enable_prefix_caching:
        logger.info("neuron_config.tensor_replacement: prefix caching off (replaced outputs change what the KV "
                    "cache holds)")
        return dataclasses.replace(args, enable_prefix_caching=False)
    return args


def _limits(args: EngineArgs, facts: ModelFacts) -> tuple[int, int, int]:
    """(max_model_len, max_num_batched_tokens, max_num_seqs): the user's, else the model's and the buckets'."""
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = facts.max_model_len
    elif max_model_len > facts.max_model_len:
        raise ValueError(f"max_model_len={max_model_len} is larger than the model's maximum context "
                         f"({facts.max_model_len}: max_position_embeddings, or a pooling model's "
                         "sentence_bert_config.json max_seq_length)")
    nc = args.additional_config.neuron_config
    max_num_batched_tokens = args.max_num_batched_tokens
    if max_num_batched_tokens is None:
        # Bucket lists given without the max: the largest bucket is the max (seeds' rule read backwards).
        given = nc.num_batched_tokens_buckets or nc.kv_segment_size_buckets
        max_num_batched_tokens = max(given) if given else min(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
    max_num_seqs = args.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = max(nc.num_seqs_buckets) if nc.num_seqs_buckets else DEFAULT_MAX_NUM_SEQS
    return max_model_len, max_num_batched_tokens, max_num_seqs


def _memory_share(args: EngineArgs, device: torch.device) -> tuple[int, float]:
    """(replicas sharing this engine's memory, its gpu_memory_utilization): this host's data-parallel
    replicas split its RAM (CPU), or the budget of a GPU they share."""
    on_cuda = device.type == "cuda"
    shared_by = replicas_sharing_memory(on_cuda, args.local_dp_replicas, torch.cuda.device_count() if on_cuda else 0)
    gmu = args.gpu_memory_utilization
    return shared_by, gmu / shared_by if on_cuda else gmu


def _check_model_options(args: EngineArgs, facts: ModelFacts) -> None:
    """Options that apply to one kind of model only."""
    ac = args.additional_config
    if not facts.multimodal:
        for option in ("limit_mm_per_prompt", "mm_processor_kwargs"):
            if getattr(args, option):
                raise ValueError(f"{option} applies to multimodal models only; this model takes text only")
        if ac.mm_language_model_only:
            raise ValueError("mm_language_model_only applies to multimodal models only; this model is text only")
        if args.mm_encoder_only or args.ec_transfer_config is not None:
            raise ValueError("mm_encoder_only and ec_transfer_config (encoder-disaggregated serving) apply to "
                             "multimodal models only; this model is text only")
        if ac.encoder_neuron_config is not None:
            raise ValueError("encoder_neuron_config applies to multimodal models only; this model is text only")
    enc = ac.encoder_neuron_config
    if enc is not None:
        enc.validate(args.tensor_parallel_size)  # tp_size * dp_size must be the world (the seed's rule)


def _async_scheduling(args: EngineArgs, nc: NeuronConfig, device: torch.device) -> tuple[bool, str]:
    """(on, why); an explicit True that cannot be honoured was refused by config/compatibility.py."""
    if args.speculative_config is not None:
        return False, "off: speculative decoding (drafts are proposed from each step's tokens on the host)"
    if nc.on_device_sampling_config is None:
        return False, "off: CPU sampling (needs on-device sampling)"
    if args.async_scheduling is None:
        return async_scheduling_default(device)
    return args.async_scheduling, "set explicitly"
