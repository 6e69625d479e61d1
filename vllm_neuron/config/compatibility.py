"""Which model runner serves a configuration, and which combinations of features are refused (pure).

The one place these are decided; the rules are the tables below, so that letting a combination work is
a change of data here (and of the code that makes it work), not of the checks:
* `MRV2_UNSUPPORTED` - features Model Runner V2 does not support. With `VLLM_USE_V2_MODEL_RUNNER` unset
  they select MRv1 and the seeds' line says so; 0 forces MRv1; 1 forces MRv2 and only warns (the seeds).
* `MRV1_MODEL_KINDS` - model kinds that run on MRv1 by default, without the seeds' line (seeds: "MoE,
  sliding-window ... models use MRv1 without a log message"); an info line of our own says why.
* `REFUSED` - combinations refused at start-up, each with its reason. A kind that is refused together
  with "mrv2" is said to run on MRv1 only.

`Features` names what a configuration uses. Before the model's config has been read its facts are None,
and the rules that need them wait until resolution (`check(features)` runs at both stages).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

V2_LOG_LINE = "Using the standalone V2 Neuron model runner."

MRV2 = "mrv2"  # the feature name of the chosen (or forced) runner in REFUSED rows

MRV2_UNSUPPORTED: dict[str, str] = {  # feature -> its name in the seeds' log lines
    "speculative": "speculative decoding",
    "cpu_sampling": "CPU sampling (on_device_sampling_config=null)",
    "eager": "eager execution (enforce_eager)",
}

MRV1_MODEL_KINDS: dict[str, str] = {  # model kind -> its name in the info line
    "moe": "MoE",
    "sliding_window": "sliding-window",
    "multimodal": "multimodal",
}


@dataclass(frozen=True)
class Refusal:
    features: frozenset[str]  # refused when the configuration has every one of them
    message: str  # str.format template over Features' fields


def _refuse(*features: str, message: str) -> Refusal:
    return Refusal(frozenset(features), message)


REFUSED: tuple[Refusal, ...] = (
    # Model kinds
    # A draft model reads the target's tapped hidden states, which a multimodal model's text tower does not give.
    *(_refuse("multimodal", f"speculative:{method}", message="speculative_config={speculative!r} is not supported "
              "yet by vllm-neuron with a multimodal model: its draft model reads the target's tapped hidden states, "
              "which the multimodal text tower does not expose; use method 'ngram'") for method in ("eagle3", "dflash")),
    _refuse("audio", "tensor_parallel", message="tensor_parallel_size={tensor_parallel_size} is not supported yet "
            "by vllm-neuron for audio models (the audio tower is not sharded); use tensor_parallel_size=1"),
    _refuse("expert_parallel", "dense", message="enable_expert_parallel=True cannot apply to this model: it has no "
            "experts (not a mixture-of-experts model), so there is nothing to shard; remove --enable-expert-parallel"),
    # Speculative decoding and sampling
    _refuse("speculative", MRV2, message="VLLM_USE_V2_MODEL_RUNNER=1 cannot serve speculative decoding: Neuron Model "
            "Runner V2 does not support it; unset VLLM_USE_V2_MODEL_RUNNER (MRv1 is then selected)"),
    _refuse("speculative", "cpu_sampling", message="speculative decoding requires on-device sampling (the rejection "
            "sampler runs in the graph), but neuron_config.on_device_sampling_config is null; enable on-device "
            "sampling or remove --speculative-config"),
    _refuse("async_scheduling", "speculative", message="async_scheduling=True is not supported with speculative "
            "decoding yet (each step's drafts need the previous step's tokens on the host); use --no-async-scheduling"),
    _refuse("async_scheduling", "cpu_sampling", message="async_scheduling=True requires on-device sampling, but "
            "neuron_config.on_device_sampling_config is null (CPU sampling); use --no-async-scheduling or enable "
            "on-device sampling"),
    # Parallelism
    _refuse("tensor_parallel", "cuda", message="tensor_parallel_size={tensor_parallel_size} is not supported yet by "
            "vllm-neuron: tensor parallelism runs on CPU (gloo) only; on CUDA it needs NCCL with one GPU per rank "
            "(NCCL does not run two ranks on one GPU), which is not built; use --device cpu, or "
            "--data-parallel-size to use several GPUs"),
    _refuse("tensor_parallel", "parallel_compile", message="NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS={compile_workers} "
            "is not supported yet by vllm-neuron: with tensor_parallel_size={tensor_parallel_size} (each rank "
            "compiles its own shard's graphs; compile workers would have to join the ranks' process group); unset it "
            "or use 1"),
    # Pipeline parallelism: the stages are built for the plain generative decoder loop (distributed/pipeline.py)
    *(_refuse("pipeline_parallel", feature, message="pipeline_parallel_size={pipeline_parallel_size} is not supported "
              f"yet by vllm-neuron with {what}: {why}; use pipeline_parallel_size=1")
      for feature, what, why in (
          ("speculative", "speculative decoding", "the draft model reads hidden states tapped across every stage"),
          ("data_parallel", "data_parallel_size={data_parallel_size}", "replicas of a pipeline are not built"),
          ("multimodal", "a multimodal model", "the encoder's embeddings enter on the first stage only"),
          ("lora", "enable_lora=True", "adapters in staged layers are not built"),
          ("prompt_embeds", "enable_prompt_embeds=True", "prompt embeddings enter on the first stage only"),
          ("kv_transfer", "kv_transfer_config", "a block holds one stage's layers on each rank"),
          ("kv_offload", "kv_offloading_size", "the tier's files are per tensor-parallel rank, not per stage"),
          ("cuda", "--device cuda", "stages talk over gloo on CPU only"),
          ("parallel_compile", "NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS={compile_workers}",
           "each stage compiles its own graphs"))),
    _refuse("multi_node_tp", "data_parallel", message="nnodes={nnodes} is not supported yet by vllm-neuron: with "
            "data_parallel_size={data_parallel_size}: each replica's tensor-parallel ranks run on its own node; "
            "spread replicas over nodes with --data-parallel-size-local and --headless"),
    _refuse("expert_parallel", "data_parallel", message="enable_expert_parallel=True is not supported yet by "
            "vllm-neuron: with data_parallel_size={data_parallel_size} (experts over the replicas); use expert "
            "parallelism within one replica"),
    # Disaggregated prefill/decode: each instance is one replica (the proxy balances over instances).
    _refuse("kv_transfer", "data_parallel", message="kv_transfer_config is not supported yet by vllm-neuron with "
            "data_parallel_size={data_parallel_size}: run one instance per replica (each with its own kv_port) "
            "behind `vllm-neuron disagg-proxy`"),
    _refuse("kv_transfer", "speculative", message="kv_transfer_config is not supported yet by vllm-neuron with "
            "speculative_config={speculative!r}: remove --speculative-config on disaggregated instances"),
    _refuse("kv_transfer", "multimodal", message="kv_transfer_config is not supported yet by vllm-neuron for "
            "multimodal models (the media's embeddings do not travel with the KV blocks)"),
    _refuse("kv_transfer", "sliding_window", message="kv_transfer_config is not supported yet by vllm-neuron for "
            "sliding-window models (their KV cache groups give blocks back as the window moves)"),
    _refuse("kv_transfer", "prompt_embeds", message="kv_transfer_config is not supported yet by vllm-neuron with "
            "enable_prompt_embeds=True (the embeddings do not travel with the KV blocks)"),
    # KV offloading: the tier is keyed by prefix-cache hashes of one full-attention group
    _refuse("kv_offload", "no_prefix_caching", message="kv_offloading_size needs prefix caching (the second tier "
            "keeps blocks under their prefix-cache hashes); remove --no-enable-prefix-caching"),
    _refuse("kv_offload", "sliding_window", message="kv_offloading_size is not supported yet by vllm-neuron for "
            "sliding-window models (their KV cache groups give blocks back as the window moves)"),
    _refuse("kv_offload", "kv_transfer", message="kv_offloading_size is not supported yet by vllm-neuron together "
            "with kv_transfer_config (one KV connector per instance)"),
    _refuse("kv_offload", "speculative", message="kv_offloading_size is not supported yet by vllm-neuron with "
            "speculative_config={speculative!r} (a draft model's KV is not offloaded)"),
    _refuse("kv_offload", "multimodal", message="kv_offloading_size is not supported yet by vllm-neuron for "
            "multimodal models"),
    # Prompt embeddings
    _refuse("prompt_embeds", "multimodal", message="enable_prompt_embeds=True is not supported yet by vllm-neuron "
            "for multimodal models (their prefill builds its own input embeddings from the media)"),
    _refuse("prompt_embeds", "speculative", message="enable_prompt_embeds=True is not supported yet by vllm-neuron "
            "with speculative decoding (drafts are proposed from the prompt's token ids, which an embeddings prompt "
            "does not have); remove --speculative-config"),
    _refuse("prompt_embeds", "tensor_parallel", message="enable_prompt_embeds=True is not supported yet by "
            "vllm-neuron with tensor_parallel_size={tensor_parallel_size}; use tensor_parallel_size=1"),
    # LoRA adapters: applied inside the Llama family's dense decoder layers (model/layers/lora.py)
    _refuse("lora", "moe", message="enable_lora=True is not supported yet by vllm-neuron for mixture-of-experts "
            "models (adapters on stacked experts are not built); LoRA serves the dense Llama / Qwen3 families"),
    _refuse("lora", "multimodal", message="enable_lora=True is not supported yet by vllm-neuron for multimodal "
            "models; LoRA serves the dense Llama / Qwen3 text families"),
    *(_refuse("lora", f"speculative:{method}", message="enable_lora=True is not supported yet by vllm-neuron with "
              "speculative_config={speculative!r}: the draft model would propose for the base model, not the "
              "request's adapter; use method 'ngram'") for method in ("eagle3", "dflash")),
    _refuse("lora", "kv_transfer", message="enable_lora=True is not supported yet by vllm-neuron with "
            "kv_transfer_config (the adapter a prefill instance used does not travel with the KV blocks)"),
    # Compilation
    _refuse("decode_cpp_wrapper", "eager_backend", message="neuron_config.decode_cpp_wrapper=true needs compiled "
            "graphs; it cannot be combined with enforce_eager or VLLM_NEURON_BACKEND=eager"),
    # CUDA decode steps replay captured graphs, which have no Python between calls to remove anyway.
    _refuse("decode_cpp_wrapper", "cuda", message="neuron_config.decode_cpp_wrapper=True is not supported yet by "
            "vllm-neuron: it is built and tested for the CPU only"),
)


@dataclass(frozen=True)
class Features:
    """What a configuration uses. The model's facts (moe, sliding_window, multimodal) are None until its
    config has been read."""

    moe: bool | None = None
    sliding_window: bool | None = None
    multimodal: bool | None = None
    audio: bool | None = None  # an audio tower (Qwen3-ASR)
    device: str = "cpu"  # the resolved device type
    speculative: str | None = None  # the method
    cpu_sampling: bool = False
    enforce_eager: bool = False
    eager_backend: bool = False  # enforce_eager or VLLM_NEURON_BACKEND=eager: no compiled graphs
    async_scheduling: bool | None = None  # as the user set it (None: the default decides)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    nnodes: int = 1
    expert_parallel: bool = False
    decode_cpp_wrapper: bool = False
    compile_workers: int = 1  # NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS
    kv_transfer: bool = False  # --kv-transfer-config (disaggregated prefill/decode)
    prompt_embeds: bool = False  # enable_prompt_embeds
    lora: bool = False  # enable_lora
    kv_offload: bool = False  # --kv-offloading-size
    prefix_caching: bool = True  # enable_prefix_caching

    def names(self) -> frozenset[str]:
        flags = {
            "moe": self.moe, "dense": self.moe is False, "sliding_window": self.sliding_window,
            "multimodal": self.multimodal, "audio": self.audio, "cuda": self.device == "cuda", "speculative": self.speculative is not None,
            "cpu_sampling": self.cpu_sampling, "eager": self.enforce_eager, "eager_backend": self.eager_backend,
            "async_scheduling": self.async_scheduling is True, "tensor_parallel": self.tensor_parallel_size > 1,
            "pipeline_parallel": self.pipeline_parallel_size > 1,
            "data_parallel": self.data_parallel_size > 1, "multi_node_tp": self.nnodes > 1,
            "expert_parallel": self.expert_parallel, "decode_cpp_wrapper": self.decode_cpp_wrapper,
            "parallel_compile": self.compile_workers > 1, "kv_transfer": self.kv_transfer,
            "prompt_embeds": self.prompt_embeds, "lora": self.lora, "kv_offload": self.kv_offload,
            "no_prefix_caching": not self.prefix_caching,
        }
        out = {name for name, on in flags.items() if on}
        if self.speculative is not None:
            out.add(f"speculative:{self.speculative}")  # a row may name one method
        return frozenset(out)


def check(features: Features, *, use_v2: bool = False) -> None:
    """Raises the first REFUSED row the configuration matches (ValueError saying why)."""
    present = features.names() | ({MRV2} if use_v2 else set())
    for row in REFUSED:
        if row.features <= present:
            raise ValueError(row.message.format(**dataclasses.asdict(features)))


def v1_only(kind: str) -> bool:
    """A model kind that cannot run on MRv2 (refused with it), rather than on MRv1 by default."""
    return any(row.features == {kind, MRV2} for row in REFUSED)


@dataclass(frozen=True)
class RunnerChoice:
    use_v2: bool
    unsupported: tuple[str, ...]  # the seeds' names of the features MRv2 does not support
    forced: bool | None  # the VLLM_USE_V2_MODEL_RUNNER value (None: unset)
    mrv1_kinds: tuple[str, ...] = ()  # MRV1_MODEL_KINDS keys of the model: MRv1 by default, without the seeds' line

    def log_message(self) -> str | None:
        """The line the seeds document for this decision, or None when nothing is logged."""
        features = ", ".join(self.unsupported)
        if self.use_v2 and self.forced and self.unsupported:
            return (f"VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with unsupported features "
                    f"({features}); execution may fail.")
        if not self.use_v2 and self.forced is None and self.unsupported and not self.mrv1_kinds:
            return f"Neuron Model Runner V2 does not yet support {features}; using V1."
        return None

    def model_reason(self) -> str | None:
        """Why the model runs on MRv1 (None when it does not, or was forced there)."""
        if self.use_v2 or self.forced is not None or not self.mrv1_kinds:
            return None
        by_default = ", ".join(MRV1_MODEL_KINDS[k] for k in self.mrv1_kinds if not v1_only(k))
        only = ", ".join(MRV1_MODEL_KINDS[k] for k in self.mrv1_kinds if v1_only(k))
        parts = []
        if by_default:
            parts.append(f"{by_default} models use MRv1 by default (MRv2 support for them is in bring-up; "
                         "VLLM_USE_V2_MODEL_RUNNER=1 runs them on MRv2)")
        if only:
            parts.append(f"{only} models run on MRv1 only (Model Runner V2 does not serve them yet)")
        return "Model Runner V1: " + "; ".join(parts)


def select_runner(features: Features, env_value: bool | None) -> RunnerChoice:
    """The runner for a configuration whose model facts are known, VLLM_USE_V2_MODEL_RUNNER's value
    (`env_value`) applied; raises when the result is a refused combination."""
    present = features.names()
    unsupported = tuple(label for name, label in MRV2_UNSUPPORTED.items() if name in present)
    kinds = tuple(kind for kind in MRV1_MODEL_KINDS if kind in present)
    if env_value is None:
        choice = RunnerChoice(not unsupported and not kinds, unsupported, None, kinds)
    else:
        choice = RunnerChoice(env_value, unsupported, env_value, kinds)
    check(features, use_v2=choice.use_v2)
    return choice
