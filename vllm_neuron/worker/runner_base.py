"""What Model Runner V1 and V2 share: loading the model, the KV cache, the compiler, the bucket graphs and the
components a runner calls at fixed points.

Every step picks the smallest bucket that fits and runs that bucket's compiled graph on one step-input
dataclass (worker/step_inputs.py). The two runners differ in where per-request state lives and what the
graphs take (model_runner_v1.py: host-built inputs; model_runner_v2.py: device-resident slot state); each
supplies its graphs, its sampling inputs and `execute`. What is special about a kind of model lives in its
`ModelKindState` (worker/model_kinds/), called the same way by both runners; speculative decoding is one
`Speculator` (worker/spec_decode/), which MRv1 holds or not. The kernels the model's layers and the graphs
take are one `KernelConfig`, decided here and handed to the model when it is built.
"""
from __future__ import annotations

import dataclasses
import mmap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vllm_neuron import envs, huge_pages
from vllm_neuron.config import buckets as B
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.kv_cache_groups import KVCacheLayout, plan_kv_cache_layout, single_group_layout
from vllm_neuron.logger import init_logger
from vllm_neuron.model.layers import kv_quant
from vllm_neuron.model.layers.kernel_config import resolve_kernel_config
from vllm_neuron.model.layers.kernels.cpu_caps import cpu_flags, describe_kernels, kernel_variant
from vllm_neuron.model.layers.paged_decode import paged_decode_available
from vllm_neuron.model.loader import Checkpoint
from vllm_neuron.model.registry import model_spec, resolve_model_class
from vllm_neuron.step import ModelRunnerOutput, NewRequestData, SchedulerOutput
from vllm_neuron.worker import memory
from vllm_neuron.worker.compilation import GraphCompiler, cache_key_parts
from vllm_neuron.worker.cuda_graphs import ReplayedGraph, cuda_graph_capturer, wants_capture
from vllm_neuron.worker.graphs import GraphOptions
from vllm_neuron.worker.input_builder import PrefillArrays, build_prefill_inputs
from vllm_neuron.worker.kv_calls import KVConnectorCalls
from vllm_neuron.worker.kv_prefault import KVPrefaulter
from vllm_neuron.worker.model_kinds import GraphSpec, ModelKindState, make_model_kinds
from vllm_neuron.worker.model_setup import LoadStats, build_model, checkpoint_scheme, zeros
from vllm_neuron.worker.pooling import Pooler, PoolingGraphs
from vllm_neuron.worker.logits_processors import LogitsProcessorBatch
from vllm_neuron.worker.prompt_logprobs import plan_prompt_logprobs, prompt_logprob_entries
from vllm_neuron.worker.sampling_state import SamplingStates
from vllm_neuron.worker.step_inputs import GroupTables, PrefillInputs, RowSampling, SlotRows, StepOutput
from vllm_neuron.worker.step_timing import ProfiledRunner, StepClock
from vllm_neuron.worker.vec_isa_probe import skip_answered_probe
from vllm_neuron.worker.tensor_debug import TensorDebug

logger = init_logger(__name__)


class ModelRunnerBase(ProfiledRunner, KVConnectorCalls):
    pooler: Pooler | None = None  # a pooling engine's (set in __init__)
    tensor_debug: TensorDebug | None = None  # neuron_config.tensor_capture / tensor_replacement (set at load)
    _eager_graphs = False  # _graph() hands out the uncompiled graph functions (TensorDebug.prepare's probe)

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                 backend: str) -> None:
        self.config = config
        self.ckpt = checkpoint
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_quant.kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        self.backend = backend  # "native" or "eager"
        nc = config.neuron_config
        self.block_size = config.block_size
        self.prefill_buckets = nc.num_batched_tokens_buckets
        self.decode_buckets = nc.num_seqs_buckets
        self.context_buckets = nc.context_buckets
        self.kv_segment = nc.kv_segment_size_buckets[0] if nc.kv_segment_size_buckets else 0
        self.odsc = nc.on_device_sampling_config
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.draft_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # the speculator's KV layers
        self.kv_prefaulter: KVPrefaulter | None = None
        self.kv_connector = None  # with --kv-transfer-config
        self.kv_tier = None  # with --kv-offloading-size
        self.model = None
        self.kinds: list[ModelKindState] = []  # set when the model is built
        self.compiler: GraphCompiler | None = None
        self.graphs = None  # the runner's StepGraphs / SlotStepGraphs
        self._bucket_graphs: dict[tuple[str, int, int], Callable] = {}
        self.step_clock = StepClock()  # step and graph times, profiler ranges (worker/step_timing.py)
        self._free_before_load: int | None = None
        self._prompt_logprobs: dict = {}  # the current step's (ModelRunnerOutput.prompt_logprobs)
        self._kv_sizing: dict | None = None
        # A pooling engine (worker/pooling.py): prefill graphs that return hidden states, pooled per request.
        self.pooler = Pooler(config.pooling) if config.pooling is not None else None
        self.model_cls = resolve_model_class(checkpoint.hf_config,
                                             config.pooling.task if config.pooling is not None else "none")
        self.model_spec = model_spec(checkpoint.hf_config, config.neuron_config.quantization)
        if self.model_spec.values_are_keys and kv_quant.is_fp8(self.kv_dtype):
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported yet for this model: its "
                             f"attention caches one latent vector per token (MLA); use kv_cache_dtype='auto'")
        wanted = config.neuron_config.int8_activations
        self.kernels = resolve_kernel_config(device, dtype, int8_activations=wanted is not False)
        if wanted and not self.kernels.int8_activations:
            raise ValueError("neuron_config.int8_activations=True needs the int8-activation kernels, built on CPUs with "
                             f"AVX512-VNNI in bfloat16 or float32 (here: device {device.type}, dtype {dtype}); "
                             "valid values here: false, or leave it unset")
        logger.info("%s", describe_kernels(device, self.dtype, self.model_spec.head_dim))
        if self.kernels.attention:  # this process built or loaded our kernels for the CPU's class
            skip_answered_probe(kernel_variant()[0], cpu_flags())
        self.sampling = SamplingStates(self.odsc, config.seed, config.logprobs_mode, LogitsProcessorBatch(
            config.logits_processors, config, torch.device("cpu")) if config.logits_processors else None,
            use_kernels=self.kernels.sampler)
        # CUDA: decode attention reads each sequence's real context (Triton), and bucket graphs replay.
        self.paged_decode = not self.kernels.attention and not self.model_spec.has_sinks_or_windows and \
            paged_decode_available(device.type, self.model_spec.head_dim, self.block_size) and \
            not kv_quant.is_fp8(self.kv_dtype)  # the Triton kernel reads the model dtype only
        self.graph_capture, self._capturer = cuda_graph_capturer(device, backend)
        checkpoint_scheme(checkpoint, self.model_spec, config)  # a refused combination fails before loading
        self.speculator = self._make_speculator()
        self.kv_layout = self._plan_kv_layout()

    def _make_speculator(self):
        """MRv1's speculator (None: no speculative decoding, or a runner without one)."""
        return None

    def kv_groups_unsupported(self) -> str | None:
        """Why this runner cannot serve several KV cache groups (None: it can)."""
        return "this model runner"

    def _plan_kv_layout(self) -> KVCacheLayout:
        spec = self.model_spec
        # A pipeline stage holds the KV of its own layers only.
        stage = ps.info().stage(spec.num_layers)
        layout = plan_kv_cache_layout(spec.sliding_windows[stage.start:stage.stop])
        why = self.kv_groups_unsupported() if layout.num_groups > 1 else None
        if why:
            logger.info("KV cache groups: 1 (%s keeps one block table per request: sliding-window layers hold "
                        "the KV of their whole sequence)", why)
            return single_group_layout(len(stage.layers))
        logger.info("%s", layout.describe())
        return layout

    # -- set-up ----------------------------------------------------------------------------------
    def load_model(self) -> LoadStats:
        # The KV budget is taken from what the device had free before our weights arrived.
        self._free_before_load = None if self.device.type == "cpu" else memory.device_free_bytes(self.device)
        t0 = time.perf_counter()
        self.model, nbytes = build_model(self.model_cls, self.ckpt, self.config, self.model_spec, self.dtype,
                                         self.device, self.kernels)
        self._bitmask_words = -(-self.ckpt.hf_config.get_text_config().vocab_size // 32)
        self.kinds = make_model_kinds(self.config, self.ckpt.hf_config, self.model, self.dtype, self.device,
                                      self._graph)
        nbytes += self._load_speculator()
        self.tensor_debug = self._make_tensor_debug()
        for k in self.kinds:
            k.capture_sink = self.tensor_debug.write_media if self.tensor_debug is not None else None
        self.compiler = GraphCompiler(cache_key_parts(self.ckpt.hf_config.to_dict(), self.dtype, self.device,
                                                      self.config.tensor_parallel_size, self._graph_options()),
                                      backend=self.backend,
                                      decode_cpp_wrapper=self.config.neuron_config.decode_cpp_wrapper,
                                      inline_layers=self.tensor_debug is not None)
        self.graphs = self._make_graphs(self._graph_static_options())
        self.graphs.taps = self.tensor_debug.taps if self.tensor_debug is not None else None
        if self.pooler is not None:
            self.graphs = PoolingGraphs(self.model, self._graph_static_options())
            self.pooler.model = self.model
        self._log_kv_segment()
        stats = LoadStats(time.perf_counter() - t0, nbytes)
        logger.info("Loaded %s (%s) in %.1f s: %.1f MiB of weights on %s as %s", type(self.model).__name__,
                    self.ckpt.path, stats.seconds, nbytes / 2**20, self.device, self.dtype)
        return stats

    def _load_speculator(self) -> int:
        """Loads the speculator's draft model, if any (bytes loaded)."""
        return 0

    def _make_tensor_debug(self) -> TensorDebug | None:
        nc = self.config.neuron_config
        if nc.tensor_capture is None and nc.tensor_replacement is None:
            return None
        k = self.speculator.k if self.speculator is not None else 0
        rows = max(self.prefill_buckets[-1], self.decode_buckets[-1] * (1 + k))
        info = ps.info()
        return TensorDebug(self.model, nc.tensor_capture, nc.tensor_replacement, rows, self.device, info.rank,
                           info.world)

    def _log_kv_segment(self) -> None:
        if self.kv_segment and not self.prefill_needs_context():
            logger.info("kv_segment_size_buckets=[%d]: %s", self.kv_segment, "the custom attention kernel reads the "
                        "cached context block by block itself; the segment size bounds the torch attention path"
                        if self.kernels.attention else "no prefill graph reads cached context")
        elif self.kv_segment:
            logger.info("kv_segment_size_buckets=[%d]: prefill attention reads the cached context (%d slots) in "
                        "segments of %d", self.kv_segment, self.context_buckets[-1], self.kv_segment)

    def num_blocks(self, weight_bytes: int) -> int:
        """Total KV blocks (block 0 is the null block), under worker/memory.py's pool-size policy; what the
        model kinds hold beside the weights (an encoder cache) comes off the budget first."""
        weight_bytes += sum(k.reserved_bytes() for k in self.kinds)
        _, kv_heads, head_dim = self.model.kv_cache_spec()
        elem = torch.finfo(self.kv_dtype).bits // 8
        # One block holds the K/V of one group's layers (KV cache groups share the pool), and the draft's.
        per_block = memory.kv_cache_bytes_per_block(self.kv_layout.group_size, kv_heads, head_dim, self.block_size,
                                                    elem)
        if self.model_spec.values_are_keys:
            per_block //= 2  # one tensor per layer (MLA's latent)
        for h, d in self._draft_kv_layers():
            per_block += memory.kv_cache_bytes_per_block(1, h, d, self.block_size, elem)

        def budget() -> memory.KVBudget:
            b = memory.kv_budget_for_device(self.device, model_weight_bytes=weight_bytes,
                                            gpu_memory_utilization=self.config.gpu_memory_utilization,
                                            free_before_load=self._free_before_load, check_minimum=False,
                                            # DP replicas and this node's TP ranks share the host.
                                            local_workers=self.config.kv_budget_shared_by * self.config.local_tp_ranks)
            logger.info("%s", b.describe())  # the line starts with "KV budget"
            return b

        persistent = self.backend != "eager" and not self.compiler.disabled
        plan = memory.plan_kv_pool(
            bytes_per_block=per_block, max_model_len=self.config.max_model_len, block_size=self.block_size,
            request_blocks=self.request_blocks(), override=self.config.num_gpu_blocks_override, budget_fn=budget,
            recorded_blocks=self.compiler.manifest_num_blocks if persistent else None,
            recorded_sizing=self.compiler.manifest_kv_sizing if persistent else None,
            record_path=str(self.compiler.manifest_path) if persistent else None)
        logger.info("%s", plan.reason)
        self._kv_sizing = plan.sizing
        return plan.num_blocks

    def request_blocks(self) -> int:
        """The most blocks one request of max_model_len holds at once, every KV cache group together."""
        return self.kv_layout.blocks_per_request(self.config.max_model_len, self.block_size,
                                                 self.config.max_num_batched_tokens)

    def _draft_kv_layers(self) -> list[tuple[int, int]]:
        return self.speculator.kv_layers() if self.speculator is not None else []

    def init_kv_cache(self, num_blocks: int) -> None:
        _, kv_heads, head_dim = self.model.kv_cache_spec()
        slots = num_blocks * self.block_size

        def pair(heads: int, dim: int, extra: int = 0, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            if shared:  # the values are the keys (MLA): one tensor stands for both
                t = zeros((slots + extra, heads, dim), self.kv_dtype, self.device)
                return t, t
            return tuple(zeros((slots + extra, heads, dim), self.kv_dtype, self.device) for _ in range(2))

        # One K/V pair per layer of a group: with several groups, layer i uses pair layer_slot[i].
        shared = self.model_spec.values_are_keys
        self.kv_caches = [pair(kv_heads, head_dim, shared=shared) for _ in range(self.kv_layout.group_size)]
        extra = self.speculator.kv_extra_slots() if self.speculator is not None else 0
        self.draft_kv = [pair(h, d, extra) for h, d in self._draft_kv_layers()]
        every = self.kv_caches + self.draft_kv
        logger.info("KV cache dtype: %s (kv_cache_dtype=%s, %d byte(s) per element, %.3f MiB per block)",
                    str(self.kv_dtype).removeprefix("torch."), self.config.kv_cache_dtype,
                    torch.finfo(self.kv_dtype).bits // 8,
                    (1 if shared else 2) * self.kv_caches[0][0][:self.block_size].nbytes * len(every) / 2**20)
        chunk_mib = envs.VLLM_NEURON_KV_PREFAULT_MB
        if self.device.type == "cpu" and chunk_mib > 0:
            pool = [t for p in every for t in p]
            huge = huge_pages.kv_wanted(pool[0].nbytes, self.device)  # as model_setup.zeros chose
            self.kv_prefaulter = KVPrefaulter(pool, self.block_size, num_blocks, chunk_mib * 2**20,
                                              page_bytes=huge_pages.PAGE if huge else mmap.PAGESIZE)
            logger.info("KV pool: pages backed ahead of the blocks in use, %d MiB at a time "
                        "(VLLM_NEURON_KV_PREFAULT_MB), in %s pages", chunk_mib, "2 MiB" if huge else "4 KiB")
        self.compiler.set_num_blocks(num_blocks, self._kv_sizing)
        if self.config.kv_transfer is not None:
            self.open_kv_connector(self.config.kv_transfer, self.model_spec.num_kv_heads)

    def idle_work(self) -> bool:
        """Work an idle engine may do between polls (backing KV pages ahead); True while some is left."""
        return self.kv_prefaulter.sweep_idle() if self.kv_prefaulter is not None else False

    def backed_blocks(self) -> int | None:
        """Blocks below this have their KV pages backed; None where pages are not backed ahead of use."""
        return self.kv_prefaulter.frontier if self.kv_prefaulter is not None else None

    def _back_kv_pages(self, sched: SchedulerOutput) -> None:
        """Backs the KV pages the step's blocks reach before the graph writes them (kv_prefault.py says why)."""
        if self.kv_prefaulter is not None and sched.chunks:
            self.kv_prefaulter.before_step([c.block_ids for c in sched.chunks] +
                                           [t for c in sched.chunks for t in c.group_block_ids])

    # -- the graphs ------------------------------------------------------------------------------
    def graph_names(self) -> list[GraphSpec]:
        """Every graph warm-up compiles: the step graphs, then the model kinds' own."""
        out = []
        for n in B.bucket_names(self.prefill_buckets, self.decode_buckets, self.context_buckets,
                                self.prefill_needs_context()):
            kind, size, ctx = B.parse_bucket_name(n)
            if kind == "decode" and not ctx:
                ctx = self.context_buckets[-1]  # a single context keeps the plain decode_b{B} name
            if kind == "decode" and self.pooler is not None:
                continue  # a pooling engine never decodes: prefill graphs only
            out.append(GraphSpec(n, kind, size, ctx))
        return out + [s for k in self.kinds for s in k.graph_specs()]

    def _max_blocks(self) -> int:
        """Block-table width of the kernel's prefill inputs (0: torch path, no tables)."""
        return self.config.max_model_len // self.block_size if self.kernels.attention else 0

    def _prefill_context(self, num_context_tokens: int) -> int:
        """Context slots of the prefill graph: the largest context bucket when any context is cached
        (torch path), 0 with the kernel."""
        return self.context_buckets[-1] if num_context_tokens and self.prefill_needs_context() else 0

    def prefill_reads_block_tables(self) -> bool:
        """A prefill step reads cached context through block tables (the attention kernel): a prompt's later
        segment costs what its tokens cost, in the plain prefill graph of its bucket."""
        return self.kernels.attention

    def prefill_needs_context(self) -> bool:
        if self.kernels.attention:
            return False  # the kernel reads cached context through block tables: no context buckets
        return self.config.enable_prefix_caching or self.config.max_model_len > self.config.max_num_batched_tokens

    def _graph_static_options(self) -> GraphOptions:
        multi = self.kv_layout.num_groups > 1
        return GraphOptions(self.odsc, self.block_size, self.kernels, self.paged_decode, self.kv_segment,
                            self.kv_layout.layer_group() if multi else None,
                            self.kv_layout.layer_slot() if multi else None)

    def _graph_options(self) -> dict:
        """What shapes the graphs beyond the model config, dtype and device (part of the cache key)."""
        opts = {"odsc": repr(self.odsc), "block_size": self.block_size, "backend": self.backend,
                "kernels": self.kernels.graph_options(), "kv_dtype": str(self.kv_dtype),
                "paged_decode": self.paged_decode, "kv_segment": self.kv_segment,
                # Each tensor-parallel rank compiles its own shard's graphs.
                "tp_rank": ps.info().rank, "ep_degree": ps.info().ep_degree,
                # Each pipeline stage compiles its own layers' graphs (and talks to its neighbours in them).
                **({"pp_rank": ps.info().pp_rank, "pp_size": ps.info().pp_size,
                    "pp_micro_batches": ps.info().pp_micro_batches} if ps.info().pp_size > 1 else {}),
                "quantization": self.config.neuron_config.quantization,
                "decode_cpp_wrapper": self.config.neuron_config.decode_cpp_wrapper,
                "kinds": [k.graph_options() for k in self.kinds],
                "prompt_embeds": self.config.enable_prompt_embeds}
        if self.tensor_debug is not None:  # the tapped modules' tensors are graph outputs / inputs
            opts["tensor_debug"] = self.tensor_debug.graph_options()
        if self.pooler is not None:
            opts["pooling"] = self.config.pooling.task  # the prefill graphs return hidden states
        if self.speculator is not None:
            opts["speculator"] = self.speculator.graph_options()
        if self.kv_layout.num_groups > 1:
            opts["kv_groups"] = [list(g.layers) for g in self.kv_layout.groups]
        return opts

    def _make_graphs(self, options: GraphOptions):
        """The bucket graph functions this runner compiles (worker/graphs.py)."""
        raise NotImplementedError

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> GraphCompiler:
        """Compiles (or loads) every graph of `graph_names()`; progress(done, total, "compiled" / "loaded") after
        each one, for whoever waits on the engine (the API server's /health says how far it got)."""
        graphs = self.graph_names()
        if self.tensor_debug is not None:
            self.tensor_debug.prepare(self._run_first_prefill_eagerly)
        if self.backend == "eager":
            logger.info("Eager execution (enforce_eager or VLLM_NEURON_BACKEND=eager): %d bucket graphs run "
                        "uncompiled; nothing to warm up", len(graphs))
            return self.compiler
        missing = set(self.compiler.missing([g.name for g in graphs]))
        what = "Compiling buckets" if missing == {g.name for g in graphs} else \
            "Loading buckets" if not missing else f"Loading and compiling buckets ({len(missing)} to compile)"
        logger.info("Warm-up: %d graphs (%s route; %d in the compile cache, %d to compile); compile cache %s",
                    len(graphs), self.backend, len(graphs) - len(missing), len(missing), self.compiler.dir)
        for i, spec in enumerate(tqdm(graphs, desc=what, unit="graph", disable=None), 1):
            # Each line says what runs next: a cold compile is minutes of silence otherwise.
            logger.info("Warming up: graph %d of %d, %s (%s) ...", i, len(graphs), spec.name,
                        "compiling it" if spec.name in missing else "loading it from the compile cache")
            self.compiler.warm(spec.name, lambda: self.warm_graph(spec))
            if progress is not None:
                progress(i, len(graphs), "compiled" if spec.name in missing else "loaded")
        self.compiler.finish()
        return self.compiler

    def warm_graph(self, spec: GraphSpec) -> None:
        """Runs one graph of `graph_names()` once on padding only."""
        if spec.kind == "prefill" and self.pooler is not None:
            self._run_pooling([], spec.size, spec.context)
        elif spec.kind == "prefill":
            self._run_prefill([], spec.size, spec.context)
        elif spec.kind == "decode":
            self._run_decode([], spec.size, spec.context)
        elif spec.kind == "verify":
            self._run_verify([], spec.size, spec.context)
        else:
            next(k for k in self.kinds if spec in k.graph_specs()).warm(spec)

    def _run_first_prefill_eagerly(self) -> None:
        self._eager_graphs = True
        try:
            self.warm_graph(next(g for g in self.graph_names() if g.kind == "prefill"))
        finally:
            self._eager_graphs = False

    def _run_graph(self, kind: str, size: int, context: int, x, chunks, rows_per_seq: int | None = 1):
        """One step's graph on x, with tensor capture / replacement around it when they are on."""
        if self.tensor_debug is None:
            return self._graph(kind, size, context)(x)
        self.tensor_debug.begin(chunks, rows_per_seq)
        out = self._graph(kind, size, context)(x)
        self.tensor_debug.end(kind, self._graph_name(kind, size, context), out.captured)
        return out

    def _graph(self, kind: str, size: int, context: int) -> Callable:
        """The compiled graph of one bucket (created on first use outside warm-up, e.g. eager)."""
        if self._eager_graphs:
            return getattr(self.graphs, kind)
        context = context or 0
        key = (kind, size, context)
        g = self._bucket_graphs.get(key)
        if g is None:
            fn = getattr(self.graphs, kind)  # the graph object's method of that kind
            name = self._graph_name(kind, size, context)
            g = self.compiler.bucket(name, fn)
            if self._capturer is not None and wants_capture(self.graph_capture, kind):
                g = ReplayedGraph(g, self._capturer, name)  # captured on its first call (warm-up)
            self._bucket_graphs[key] = g
        return self.step_clock.timed(g)

    def _graph_name(self, kind: str, size: int, context: int) -> str:
        if kind == "prefill":
            return B.bucket_name("prefill", size, context or None)
        if kind == "decode":
            return B.bucket_name("decode", size, context if len(self.context_buckets) > 1 else None)
        return next(s.name for k in self.kinds for s in k.graph_specs() if (s.kind, s.size) == (kind, size))

    # -- step inputs -----------------------------------------------------------------------------
    def _t(self, a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(a).to(self.device, non_blocking=True)

    def _bitmask(self, chunks, rows: int, masks: dict) -> np.ndarray | None:
        if not masks and self.backend == "eager":
            return None  # eager can skip the full-vocabulary unpack; a compiled graph keeps one signature
        out = np.full((rows, self._bitmask_words), -1, np.int32)
        for i, c in enumerate(chunks):
            m = masks.get(c.req_id)
            if m is not None and c.sample:
                out[i] = m
        return out

    def _prefill_inputs(self, chunks, num_tokens: int, num_context: int, masks: dict | None,
                        sampling: Callable[[int], RowSampling | SlotRows]) -> tuple[PrefillInputs, PrefillArrays]:
        """A prefill step's graph inputs (prompt tokens are new data for both runners) and the host arrays
        they came from; sampling(rows) gives the runner's sampling inputs."""
        rows = min(self.config.max_num_seqs, num_tokens)
        a = build_prefill_inputs(chunks, num_tokens, num_context, rows, self.block_size, self._max_blocks())
        kern = self.kernels.attention
        tables = "seq_tables" if kern else "context_slots"
        x = PrefillInputs(
            self._t(a.input_ids), self._t(a.positions), self._t(a.slot_mapping), self._t(a.query_seq),
            self._t(a.logits_indices), self.kv_caches, sampling(rows), self._t(self._bitmask(chunks, rows, masks or {})),
            seq_tables=self._t(a.seq_tables) if kern else None, query_start=self._t(a.query_start) if kern else None,
            context_slots=None if kern else self._t(a.context_slots),
            context_seq=None if kern else self._t(a.context_seq),
            groups=self._group_tables(chunks, lambda c: build_prefill_inputs(
                c, num_tokens, num_context, rows, self.block_size, self._max_blocks()), tables),
            model_kwargs={k: v for kind in self.kinds for k, v in kind.prefill_kwargs(chunks, a).items()},
            draft_kv=self.draft_kv)
        if self.config.enable_prompt_embeds:
            x.embeds, x.embeds_rows = self._prompt_embeds_rows(chunks, num_tokens)
        return x, a

    def _prompt_embeds_rows(self, chunks, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, hidden] embeddings, [T] where they replace the token embeddings) of a prefill step: the prompt
        positions of requests that came with prompt_embeds."""
        embeds = torch.zeros(num_tokens, self.ckpt.hf_config.get_text_config().hidden_size, dtype=self.dtype)
        rows = torch.zeros(num_tokens, dtype=torch.bool)
        t = 0
        for c in chunks:
            st = self.sampling.states.get(c.req_id)
            given = st.data.prompt_embeds if st is not None else None
            end = min(c.start_pos + len(c.token_ids), given.shape[0]) if given is not None else 0
            if end > c.start_pos:
                embeds[t:t + end - c.start_pos] = given[c.start_pos:end]
                rows[t:t + end - c.start_pos] = True
            t += len(c.token_ids)
        return embeds.to(self.device), rows.to(self.device)

    def _group_tables(self, chunks, build: Callable[[list], Any], tables: str) -> tuple[GroupTables, ...]:
        """KV cache groups 1..: each group's (slot_mapping, `tables` field) of the same step's host arrays built
        through its block tables; () for a one-group model."""
        out = []
        for g in range(1, self.kv_layout.num_groups):
            a = build([dataclasses.replace(c, block_ids=c.group_block_ids[g - 1]) for c in chunks])
            out.append(GroupTables(self._t(a.slot_mapping), self._t(getattr(a, tables))))
        return tuple(out)

    # -- one step --------------------------------------------------------------------------------
    def _joins_and_leaves(self, sched: SchedulerOutput) -> None:
        """The step's finished, preempted and new requests, for the sampling state and the model kinds."""
        for rid in sched.finished_req_ids:
            self.sampling.remove(rid)
            for k in self.kinds:
                k.remove_request(rid)
        for rid, n in sched.preempted_req_ids.items():
            self.sampling.truncate(rid, n)
        for data in sched.new_requests:
            self._add_request(data)

    def _add_request(self, data: NewRequestData) -> None:
        self.sampling.add(data)
        for k in self.kinds:
            k.add_request(data)

    def _step_bucket(self, sched: SchedulerOutput) -> tuple[int, int, str, int]:
        """(size, context, graph name, padding) of the bucket that serves this step."""
        if sched.kind == "prefill":
            n = sched.num_tokens
            size = B.select_bucket(self.prefill_buckets, n)
            context = self._prefill_context(sched.num_context_tokens)
            return size, context, self._graph_name("prefill", size, context), size - n
        n = len(sched.chunks)
        size = B.select_bucket(self.decode_buckets, n)
        context = B.select_bucket(self.context_buckets, sched.max_seq_len)
        return size, context, self._graph_name("decode", size, context), size - n

    def _finalize_rows(self, chunks, tokens, logits) -> tuple[list[str], dict, dict]:
        """(request ids of the sampling rows, their tokens, their logprobs), host-sampling rows that need it."""
        rows = [i for i, c in enumerate(chunks) if c.sample]
        req_ids = [chunks[i].req_id for i in rows]
        if not rows:
            return req_ids, {}, {}
        sampled, logprobs = self.sampling.finalize(req_ids, tokens, logits, rows)
        return req_ids, sampled, logprobs

    def _call_prefill(self, x: PrefillInputs, chunks, num_tokens: int, num_context: int) -> StepOutput:
        """The prefill bucket's graph on x. A step with requests that want prompt logprobs runs the same graph
        function eagerly and computes the logits of their prompt rows too (the compiled graph keeps only
        each chunk's last row); the scheduler puts such requests in steps of their own."""
        plan = plan_prompt_logprobs(chunks, self.sampling.states, self.ckpt.hf_config.get_text_config().vocab_size,
                                    self.device)
        if plan is None:
            return self._run_graph("prefill", num_tokens, num_context, x, chunks, None)
        if self.tensor_debug is not None:
            self.tensor_debug.begin(chunks, None)
        out, lp = self.graphs.prefill_with_prompt_logprobs(x, plan.rows)
        if self.tensor_debug is not None:
            self.tensor_debug.end("prefill", self._graph_name("prefill", num_tokens, num_context), out.captured)
        self._prompt_logprobs = prompt_logprob_entries(plan, lp)
        return out

    def _take_prompt_logprobs(self) -> dict:
        out, self._prompt_logprobs = self._prompt_logprobs, {}
        return out

    def _run_prefill(self, chunks, num_tokens: int, num_context: int, masks: dict | None = None):
        raise NotImplementedError

    def _run_decode(self, chunks, batch: int, context: int, masks: dict | None = None):
        raise NotImplementedError

    def _run_verify(self, chunks, batch: int, context: int, masks: dict | None = None):
        raise NotImplementedError(f"{type(self).__name__} has no verification graphs")

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    # -- a pooling engine's step (worker/pooling.py) ------------------------------------------------
    def _run_pooling(self, chunks, num_tokens: int, num_context: int) -> torch.Tensor:
        x, _ = self._prefill_inputs(chunks, num_tokens, num_context, None, lambda rows: None)
        with torch.inference_mode():
            return self._graph("prefill", num_tokens, num_context)(x)

    def _execute_pooling(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """A pooling engine's step (always a prefill): the hidden states of its chunks, pooled."""
        self._back_kv_pages(sched)
        for rid in sched.finished_req_ids:
            self.pooler.remove(rid)
        for rid in sched.preempted_req_ids:
            self.pooler.restart(rid)
        for data in sched.new_requests:
            self.pooler.add(data)
        if sched.kind != "prefill":
            raise RuntimeError("a pooling engine got a decode step")
        size, context, name, padding = self._step_bucket(sched)
        hidden = self._run_pooling(sched.chunks, size, context)
        return ModelRunnerOutput({}, bucket_name=name, num_padding=padding, pooled=self.pooler.pool(sched.chunks, hidden))

    def encoder_cache_stats(self) -> tuple[int, int, int] | None:
        """(hits, misses, evictions) of the encoder cache, cumulative; None for a model without one."""
        return next((s for s in (k.encoder_cache_stats() for k in self.kinds) if s is not None), None)
