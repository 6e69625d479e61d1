"""What Model Runner V1 and V2 share: loading the model, the KV cache, the compiler and the bucket graphs.

Every step picks the smallest bucket that fits and runs that bucket's compiled graph. The two runners
differ in where per-request state lives and what the graphs take as inputs (model_runner_v1.py: host-built
inputs; model_runner_v2.py: device-resident slot state); each supplies its graphs, its input builders
and `execute`.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vllm_neuron.config import buckets as B
from vllm_neuron.config.device import check_weight_quantization
from vllm_neuron import envs, huge_pages
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.kv_cache_groups import KVCacheLayout, plan_kv_cache_layout, single_group_layout
from vllm_neuron.logger import init_logger
from vllm_neuron.model.layers import kv_quant, quant_fp8
from vllm_neuron.model.layers import packed_weights
from vllm_neuron.model.layers.kernels import (cpu_flags, describe_kernels, kernel_variant, kernels_enabled, linear_kernel_rows,
                                              quant_kernels_available)
from vllm_neuron.model.layers.activation import set_activation_kernel
from vllm_neuron.model.layers.in_graph_sampler import set_sampler_kernels
from vllm_neuron.model.layers.linear import (make_linears_fp8_, quantize_linears_, set_prepacked,
                                             set_quant_kernels, set_small_batch_kernel)
from vllm_neuron.model.layers.paged_decode import paged_decode_available
from vllm_neuron.model.loader import Checkpoint
from vllm_neuron.model.registry import model_spec, resolve_model_class
from vllm_neuron.step import ModelRunnerOutput, SchedulerOutput
from vllm_neuron.worker import memory
from vllm_neuron.worker.compilation import GraphCompiler, cache_key_parts
from vllm_neuron.worker.cuda_graphs import ReplayedGraph, cuda_graph_capturer, wants_capture
from vllm_neuron.worker.input_builder import build_prefill_inputs
from vllm_neuron.worker.kv_prefault import KVPrefaulter
from vllm_neuron.worker.parallel_compile import compile_worker, run_bucket_workers
from vllm_neuron.worker.sampling_state import SamplingStates

logger = init_logger(__name__)


@dataclass
class LoadStats:
    seconds: float
    nbytes: int


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed KV memory. On CPU it comes from calloc through numpy, so the OS maps zero pages lazily
    and a multi-GiB cache costs nothing until used (torch.zeros would touch every page at start)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    bits = torch.finfo(dtype).bits
    raw = np.zeros(shape, dtype={8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}[bits])
    return torch.from_numpy(raw).view(dtype)


class ModelRunnerBase:
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
        self.sampling = SamplingStates(self.odsc, config.seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_prefaulter: KVPrefaulter | None = None
        self.model = None
        self.compiler: GraphCompiler | None = None
        self.graphs = None  # the runner's StepGraphs / StepGraphsV2
        self._bucket_graphs: dict[tuple[str, int, int], Callable] = {}
        self._free_before_load: int | None = None
        self._kv_sizing: dict | None = None
        self.model_cls = resolve_model_class(checkpoint.hf_config)
        self.model_spec = model_spec(checkpoint.hf_config, config.neuron_config.quantization)
        # FP8 static weights come from the checkpoint's quantization_config (any other scheme is refused here).
        self.ckpt_scheme, self.ckpt_unquantized = quant_fp8.checkpoint_weight_scheme(
            checkpoint.hf_config, self.model_spec.quantizations)
        if self.ckpt_scheme and config.neuron_config.quantization:
            raise ValueError(f"neuron_config.quantization={config.neuron_config.quantization!r} cannot apply to a "
                             f"checkpoint whose weights are already quantized ({self.ckpt_scheme}); remove it")
        self.use_kernels = kernels_enabled(device)  # sinks and sliding windows included
        set_sampler_kernels(self.use_kernels)
        set_activation_kernel(self.use_kernels)
        kernel_rows = linear_kernel_rows(device)
        self.linear_kernel_rows = kernel_rows.get(self.dtype, 0)
        set_small_batch_kernel(frozenset(kernel_rows), self.linear_kernel_rows)
        logger.info("%s", describe_kernels(device, self.dtype, self.model_spec.head_dim))
        self.use_quant_kernels = quant_kernels_available(device)
        set_quant_kernels(self.use_quant_kernels)
        # On AVX512-BF16 / AMX CPUs the rows above the kernel's take oneDNN on weights reordered once (custom kernels on).
        self.prepacked = self.use_kernels and packed_weights.available(device, dtype, cpu_flags())
        set_prepacked(self.prepacked)
        # CUDA: decode attention reads each sequence's real context (Triton), and bucket graphs replay.
        self.paged_decode = not self.use_kernels and not self.model_spec.has_sinks_or_windows and \
            paged_decode_available(device.type, self.model_spec.head_dim, self.block_size) and \
            not kv_quant.is_fp8(self.kv_dtype)  # the Triton kernel reads the model dtype only
        self.graph_capture, self._capturer = cuda_graph_capturer(device, backend)
        self.kv_layout = self._plan_kv_layout()

    def kv_groups_unsupported(self) -> str | None:
        """Why this runner cannot serve several KV cache groups (None: it can)."""
        return "this model runner"

    def _plan_kv_layout(self) -> KVCacheLayout:
        spec = self.model_spec
        layout = plan_kv_cache_layout(spec.sliding_windows)
        why = self.kv_groups_unsupported() if layout.num_groups > 1 else None
        if why:
            logger.info("KV cache groups: 1 (%s keeps one block table per request: sliding-window layers hold "
                        "the KV of their whole sequence)", why)
            return single_group_layout(spec.num_layers)
        logger.info("%s", layout.describe())
        return layout

    # -- set-up ----------------------------------------------------------------------------------
    def load_model(self) -> LoadStats:
        cls = self.model_cls
        # The KV budget is taken from what the device had free before our weights arrived.
        self._free_before_load = None if self.device.type == "cpu" else memory.device_free_bytes(self.device)
        t0 = time.perf_counter()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                extra = {"language_model_only": self.config.additional_config.mm_language_model_only} \
                    if getattr(cls, "multimodal", False) else {}
                model = cls(self.ckpt.hf_config, quantization=self.config.neuron_config.quantization, **extra)
        finally:
            torch.set_default_dtype(prev)
        if self.ckpt_scheme == "fp8":
            n = make_linears_fp8_(model, self.ckpt_unquantized)
            logger.info("FP8 static weights (ModelOpt checkpoint): %d linear layers hold float8_e4m3fn weights "
                        "and compute in %s", n, self.dtype)
        kv_scales: list[str] = []
        nbytes = model.load_weights(tqdm(kv_quant.tap_scales(self.ckpt.iter_weights(self.dtype), kv_scales),
                                         desc="Loading weights", unit="tensor", leave=False, disable=None))
        if kv_quant.is_fp8(self.kv_dtype):
            kv_quant.log_scales(self.config.kv_cache_dtype, kv_scales, model.kv_cache_spec()[0])
        self.model = model.eval().requires_grad_(False)
        scheme = self.config.neuron_config.quantization
        if scheme in ("int8", "int4"):  # mxfp4 belongs to the gpt-oss experts' own loading
            check_weight_quantization(scheme, self.dtype, self.device)
            layers, before, after = quantize_linears_(self.model, scheme)
            logger.info("Weight-only %s: %d linear layers, %.1f MiB -> %.1f MiB (%s kernel for decode)", scheme,
                        layers, before / 2**20, after / 2**20, "custom" if self.use_quant_kernels else "no")
        if self.device.type == "cpu" and huge_pages.available():
            moved, nbytes = huge_pages.move_parameters_(self.model)
            logger.info("Weights in 2 MiB pages: %d tensors, %.1f MiB (VLLM_NEURON_HUGE_PAGES=0 keeps 4 KiB ones)",
                        moved, nbytes / 2**20)
        if self.prepacked:
            self._pack_weights()
        self._bitmask_words = -(-self.ckpt.hf_config.get_text_config().vocab_size // 32)
        nbytes += self._load_draft()
        self.compiler = self._make_compiler()
        self.graphs = self._make_graphs()
        self.graphs.kv_segment = self.kv_segment
        if self.kv_segment and not self.prefill_needs_context():
            logger.info("kv_segment_size_buckets=[%d]: %s", self.kv_segment, "the custom attention kernel reads the "
                        "cached context block by block itself; the segment size bounds the torch attention path"
                        if self.use_kernels else "no prefill graph reads cached context")
        elif self.kv_segment:
            logger.info("kv_segment_size_buckets=[%d]: prefill attention reads the cached context (%d slots) in "
                        "segments of %d", self.kv_segment, self.context_buckets[-1], self.kv_segment)
        stats = LoadStats(time.perf_counter() - t0, nbytes)
        logger.info("Loaded %s (%s) in %.1f s: %.1f MiB of weights on %s as %s", type(model).__name__,
                    self.ckpt.path, stats.seconds, nbytes / 2**20, self.device, self.dtype)
        return stats

    def num_blocks(self, weight_bytes: int) -> int:
        """Total KV blocks (block 0 is the null block), under worker/memory.py's pool-size policy."""
        _, kv_heads, head_dim = self.model.kv_cache_spec()
        # One block holds the K/V of one group's layers (KV cache groups share the pool).
        per_block = memory.kv_cache_bytes_per_block(self.kv_layout.group_size, kv_heads, head_dim, self.block_size,
                                                    torch.finfo(self.kv_dtype).bits // 8)
        for kv_heads, head_dim in self._extra_kv_layers():
            per_block += memory.kv_cache_bytes_per_block(1, kv_heads, head_dim, self.block_size,
                                                         torch.finfo(self.kv_dtype).bits // 8)

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

    def init_kv_cache(self, num_blocks: int) -> None:
        _, kv_heads, head_dim = self.model.kv_cache_spec()
        # One K/V pair per layer of a group: with several groups, layer i uses pair layer_slot[i]; a draft
        # model's layers follow (speculative decoding keeps one group).
        shapes = [(kv_heads, head_dim, 0)] * self.kv_layout.group_size + \
            [(h, d, self._extra_kv_slots()) for h, d in self._extra_kv_layers()]
        self.kv_caches = [tuple(_zeros((num_blocks * self.block_size + x, h, d), self.kv_dtype, self.device)
                                for _ in range(2)) for h, d, x in shapes]
        logger.info("KV cache dtype: %s (kv_cache_dtype=%s, %d byte(s) per element, %.3f MiB per block)",
                    str(self.kv_dtype).removeprefix("torch."), self.config.kv_cache_dtype,
                    torch.finfo(self.kv_dtype).bits // 8,
                    2 * self.kv_caches[0][0][:self.block_size].nbytes * len(self.kv_caches) / 2**20)
        chunk_mib = envs.VLLM_NEURON_KV_PREFAULT_MB
        if self.device.type == "cpu" and chunk_mib > 0:
            self.kv_prefaulter = KVPrefaulter([t for pair in self.kv_caches for t in pair], self.block_size,
                                              num_blocks, chunk_mib * 2**20)
            logger.info("KV pool: pages backed ahead of the blocks in use, %d MiB at a time "
                        "(VLLM_NEURON_KV_PREFAULT_MB)", chunk_mib)
        self.compiler.set_num_blocks(num_blocks, self._kv_sizing)

    def idle_work(self) -> bool:
        """Work an idle engine may do between polls (backing KV pages ahead); True while some is left."""
        return self.kv_prefaulter.sweep_idle() if self.kv_prefaulter is not None else False

    def _back_kv_pages(self, sched: SchedulerOutput) -> None:
        """Backs the KV pages the step's blocks reach before the graph writes them (kv_prefault.py says why)."""
        if self.kv_prefaulter is not None and sched.chunks:
            self.kv_prefaulter.before_step([c.block_ids for c in sched.chunks] +
                                           [t for c in sched.chunks for t in c.group_block_ids])

    def graph_names(self) -> list[tuple[str, str, int, int]]:
        """(name, kind, size, context) for every graph warm-up compiles."""
        names = B.bucket_names(self.prefill_buckets, self.decode_buckets, self.context_buckets,
                               self.prefill_needs_context())
        out = []
        for n in names:
            kind, size, ctx = B.parse_bucket_name(n)
            if kind == "decode" and not ctx:
                ctx = self.context_buckets[-1]  # a single context keeps the plain decode_b{B} name
            out.append((n, kind, size, ctx))
        return out

    def _max_blocks(self) -> int:
        """Block-table width of the kernel's prefill inputs (0: torch path, no tables)."""
        return self.config.max_model_len // self.block_size if self.use_kernels else 0

    def _prefill_context(self, num_context_tokens: int) -> int:
        """Context slots of the prefill graph: the largest context bucket when any context is cached
        (torch path), 0 with the kernel."""
        return self.context_buckets[-1] if num_context_tokens and self.prefill_needs_context() else 0

    def prefill_needs_context(self) -> bool:
        if self.use_kernels:
            return False  # the kernel reads cached context through block tables: no context buckets
        return self.config.enable_prefix_caching or self.config.max_model_len > self.config.max_num_batched_tokens

    def _graph_options(self) -> dict:
        """What shapes the graphs beyond the model config, dtype and device (part of the cache key)."""
        return {"odsc": repr(self.odsc), "block_size": self.block_size, "backend": self.backend,
                "kernels": self.use_kernels, "linear_kernel_rows": self.linear_kernel_rows,
                "kernel_variant": kernel_variant()[0] if self.use_kernels else None,
                "quant_kernels": self.use_quant_kernels, "prepacked": self.prepacked, "kv_dtype": str(self.kv_dtype),
                "paged_decode": self.paged_decode, "kv_segment": self.kv_segment,
                # Each tensor-parallel rank compiles its own shard's graphs.
                "tp_rank": ps.info().rank, "ep_degree": ps.info().ep_degree,
                "quantization": self.config.neuron_config.quantization,
                "decode_cpp_wrapper": self.config.neuron_config.decode_cpp_wrapper,
                **({"kv_groups": [list(g.layers) for g in self.kv_layout.groups]}
                   if self.kv_layout.num_groups > 1 else {})}

    def _pack_weights(self) -> None:
        """Packed copies of the bf16 linear weights for the rows above the decode kernel's (packed_weights.py),
        unless they would take more than half of the host's available memory: a model that fits once may
        not fit twice, and without its copy a weight takes F.linear (same results, same graphs)."""
        need, free = packed_weights.packed_bytes(self.model), memory.host_available_bytes()
        if need > free // 2:
            logger.warning("Weights not packed: the copies (%.1f MiB) would take more than half of the "
                           "host's available memory (%.1f MiB); F.linear serves the rows above %d", need / 2**20,
                           free / 2**20, self.linear_kernel_rows)
            return
        layers, added = packed_weights.pack_linears_(self.model)
        logger.info("Weights packed once: %d bf16 linear layers above %d rows, %s (+%.1f MiB beside the weights "
                    "the decode kernel streams)", layers, self.linear_kernel_rows,
                    packed_weights.describe_copies(), added / 2**20)

    def _make_compiler(self) -> GraphCompiler:
        return GraphCompiler(cache_key_parts(self.ckpt.hf_config.to_dict(), self.dtype, self.device,
                                             self.config.tensor_parallel_size, self._graph_options()),
                             backend=self.backend,
                             decode_cpp_wrapper=self.config.neuron_config.decode_cpp_wrapper)

    def warmup(self) -> GraphCompiler:
        graphs = self.graph_names()
        if self.backend == "eager":
            logger.info("Eager execution (enforce_eager or VLLM_NEURON_BACKEND=eager): %d bucket graphs run "
                        "uncompiled; nothing to warm up", len(graphs))
            return self.compiler
        logger.info("Warm-up: %d graphs (%s route); compile cache %s", len(graphs), self.backend, self.compiler.dir)
        self._compile_in_workers([g[0] for g in graphs])
        for i, (name, kind, size, ctx) in enumerate(tqdm(graphs, desc="Compiling buckets", unit="graph",
                                                         disable=None), 1):
            # Each line says what runs next: a cold compile is minutes of silence otherwise.
            logger.info("Bucket %d/%d: %s (loading it from the compile cache, else compiling it) ...", i, len(graphs),
                        name)
            run = getattr(self, f"_run_{kind}")  # _run_prefill / _run_decode / a runner's own kinds
            self.compiler.warm(name, lambda: run([], size, ctx))
        self.compiler.finish()
        return self.compiler

    def _compile_in_workers(self, names: list[str]) -> None:
        """NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS > 1: the buckets missing from the cache are compiled by
        that many processes first; the warm-up loop then loads them."""
        workers = envs.NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS or 1
        missing = self.compiler.missing(names)
        if workers <= 1 or len(missing) <= 1 or self.compiler.disabled or self.compiler.fail_on_miss:
            return  # (VLLM_NEURON_DISABLE_WARMUP_COMPILE: a missing bucket stays fatal)
        n = min(workers, len(missing))
        threads = max(1, torch.get_num_threads() // n)
        logger.info("Compiling %d buckets in %d worker processes (%d torch threads each; each holds its own "
                    "copy of the weights and the KV pool): %s", len(missing), n, threads, ", ".join(missing))
        t0 = time.perf_counter()
        seconds = run_bucket_workers(missing, n, compile_worker, (
            self.config, self.device, self.dtype, self.backend, self.compiler.num_blocks, self._kv_sizing,
            self.compiler.key, threads), timeout=self.compiler.timeout)
        self.compiler.record_compiled(seconds)
        logger.info("Parallel compilation of %d buckets done in %.1f s (%.1f s of compilation)", len(missing),
                    time.perf_counter() - t0, sum(seconds.values()))

    def _load_draft(self) -> int:
        """Loads a speculative draft model beside the target (bytes loaded; 0: none)."""
        return 0

    def _extra_kv_layers(self) -> list[tuple[int, int]]:
        """(kv heads, head dim) of KV layers past the target's (a draft model's), same blocks and slots."""
        return []

    def _extra_kv_slots(self) -> int:
        """Slots those layers hold past the pool's (a DFlash draft's scratch blocks)."""
        return 0

    # -- graphs ----------------------------------------------------------------------------------
    def _make_graphs(self):
        """The bucket graph functions this runner compiles (worker/graphs.py)."""
        raise NotImplementedError

    def _graph(self, kind: str, size: int, context: int) -> Callable:
        """The compiled graph of one bucket (created on first use outside warm-up, e.g. eager)."""
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
        return g

    def _graph_name(self, kind: str, size: int, context: int) -> str:
        if kind == "prefill":
            return B.bucket_name("prefill", size, context or None)
        return B.bucket_name("decode", size, context if len(self.context_buckets) > 1 else None)

    def _prefill_attn_inputs(self, x) -> tuple:
        return (x.seq_tables, x.query_start) if self.use_kernels else (x.context_slots, x.context_seq)

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

    def _run_prefill(self, chunks, num_tokens: int, num_context: int, masks: dict | None = None):
        """Runs one prefill bucket graph; warm-up calls it with no chunks. Returns (tokens, logits)."""
        raise NotImplementedError

    def _prefill_graph(self, chunks, num_tokens: int, num_context: int, masks: dict | None,
                       row_inputs: Callable[[int], tuple], step_inputs: Callable[[Any], tuple] | None = None):
        """Runs the prefill graph on host-built inputs (prompt tokens are new data for both runners);
        row_inputs(rows) gives the runner's per-row sampling inputs, which follow the shared ones, and
        step_inputs(prefill inputs) any further model inputs (a multimodal runner's), which come last."""
        rows = min(self.config.max_num_seqs, num_tokens)
        x = build_prefill_inputs(chunks, num_tokens, num_context, rows, self.block_size, self._max_blocks())
        attn_a, attn_b = self._prefill_attn_inputs(x)
        groups = self._group_inputs(chunks, lambda c: build_prefill_inputs(
            c, num_tokens, num_context, rows, self.block_size, self._max_blocks()),
            "seq_tables" if self.use_kernels else "context_slots")
        with torch.inference_mode():
            graph = self._graph("prefill", num_tokens, num_context)
            return graph(self._t(x.input_ids), self._t(x.positions), self._t(x.slot_mapping),
                         self._t(x.query_seq), self._t(attn_a), self._t(attn_b),
                         self._t(x.logits_indices), self._t(self._bitmask(chunks, rows, masks or {})),
                         *row_inputs(rows), *(step_inputs(x) if step_inputs else ()), self.kv_caches, *groups)

    def _group_inputs(self, chunks, build: Callable[[list], Any], tables: str) -> tuple:
        """The graphs' trailing input for KV cache groups 1..: each group's (slot_mapping, `tables` field) of
        the same step inputs built through its block tables; () for a one-group model."""
        out = []
        for g in range(1, self.kv_layout.num_groups):
            x = build([dataclasses.replace(c, block_ids=c.group_block_ids[g - 1]) for c in chunks])
            out.append((self._t(x.slot_mapping), self._t(getattr(x, tables))))
        return (tuple(out),) if out else ()

    def _run_decode(self, chunks, batch: int, context: int, masks: dict | None = None):
        """Runs one decode bucket graph; warm-up calls it with no chunks. Returns (tokens, logits)."""
        raise NotImplementedError

    # -- one step --------------------------------------------------------------------------------
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

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def encoder_cache_stats(self) -> tuple[int, int] | None:
        """(hits, misses) of the encoder cache, cumulative; None for a model without one."""
        return None
