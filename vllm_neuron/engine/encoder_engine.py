"""An EPD encoder instance's engine (--mm-encoder-only): the vision tower and its encoder graphs, nothing else.

No language-model weight is loaded, no KV pool is allocated and no prefill / decode graph exists: warm-up
compiles (or loads) only the `encoder_p{patches}` buckets. An encode request's media go through the same
processor a prefill+decode instance runs (so both compute the same media hash), the items the encoder cache
lacks through the tower (block-packed, one graph call per group, the runner's multimodal state), and every
item's embeddings to the EC connector (distributed/ec_transfer/). One encode runs at a time (the server
calls `encode` from a worker thread); a connector that cannot write fails that request only.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.distributed.ec_transfer.connectors import make_ec_connector
from vllm_neuron.distributed.ec_transfer.record import model_identity
from vllm_neuron.engine.input_processor import multimodal_processor
from vllm_neuron.logger import init_logger
from vllm_neuron.model.layers.kernel_config import apply_kernel_config, resolve_kernel_config
from vllm_neuron.model.loader import Checkpoint, load_tokenizer
from vllm_neuron.model.qwen3_vl.encoder_only import Qwen3VLVisionTower
from vllm_neuron.model.registry import resolve_model_class
from vllm_neuron.worker.compilation import GraphCompiler, cache_key_parts
from vllm_neuron.worker.model_kinds.multimodal import MultimodalState

logger = init_logger(__name__)


@dataclass
class EncodeResult:
    mm_hashes: list[str]
    encoded: int  # items the tower ran for
    cached: int  # items the encoder cache held
    bytes_written: int
    seconds: float


class _EncoderGraphs:
    """The encoder graph function (GraphCompiler compiles bound methods of an object holding the model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def encode(self, x) -> tuple:
        return self.model.encode(x.pixels, x.interp_idx, x.interp_w, x.rot_pos, x.segment)


class EncoderEngine:
    def __init__(self, config: EngineConfig, ckpt: Checkpoint) -> None:
        cls = resolve_model_class(ckpt.hf_config)
        if not hasattr(cls, "encode"):
            raise ValueError(f"--mm-encoder-only serves vision-language models (Qwen3-VL); {cls.__name__} has no "
                             "vision tower")
        self.config, self.ckpt = config, ckpt
        self.device, self.dtype = config.torch_device, config.torch_dtype
        t0 = time.perf_counter()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = Qwen3VLVisionTower(ckpt.hf_config)
        finally:
            torch.set_default_dtype(prev)
        # The same layer kernels as a monolithic engine's tower (its numerics, not just its shapes).
        kernels = resolve_kernel_config(self.device, self.dtype)
        apply_kernel_config(model, kernels)
        nbytes = model.load_weights(ckpt.iter_weights(self.dtype))
        self.model = model.eval().requires_grad_(False)
        logger.info("Encoder instance: vision tower of %s loaded in %.1f s (%.1f MiB as %s on %s); no language "
                    "model, no KV pool", ckpt.path, time.perf_counter() - t0, nbytes / 2**20, self.dtype, self.device)
        self._graphs = _EncoderGraphs(self.model)
        self._bucket_graphs: dict[int, object] = {}
        # The runner's multimodal state does the packing and bucket choice; it reads no connector here.
        self.state = MultimodalState(dataclasses.replace(config, ec_transfer_config=None), ckpt.hf_config,
                                     self.model, self.dtype, self.device, self._graph)
        options = {"role": "mm_encoder_only", "encoder_block": self.state.encoder_block,
                   "kinds": [self.state.graph_options()], "kernels": kernels.graph_options()}
        self.compiler = GraphCompiler(cache_key_parts(ckpt.hf_config.to_dict(), self.dtype, self.device, 1, options),
                                      backend=config.backend)
        self.connector = make_ec_connector(config.ec_transfer_config, model_identity(ckpt.hf_config.to_dict(),
                                                                                     config.model))
        self.tokenizer = load_tokenizer(config.tokenizer or ckpt)
        self.processor = multimodal_processor(config, ckpt, self.tokenizer)
        self._lock = threading.Lock()
        self.items_encoded = 0
        self.items_cached = 0

    def _graph(self, kind: str, size: int, context: int):
        g = self._bucket_graphs.get(size)
        if g is None:
            g = self._bucket_graphs[size] = self.compiler.bucket(f"encoder_p{size}", self._graphs.encode)
        return g

    def warmup(self) -> None:
        specs = self.state.graph_specs()
        if self.config.backend == "eager":
            logger.info("Eager execution: %d encoder buckets run uncompiled", len(specs))
            return
        for spec in specs:
            logger.info("Warming up encoder bucket %s ...", spec.name)
            self.compiler.warm(spec.name, lambda: self.state.warm(spec))
        self.compiler.finish()

    def encode(self, media: dict[str, list], mm_processor_kwargs: dict | None = None) -> EncodeResult:
        """Processes `media` ({"image": [...], "video": [...]}), encodes what the cache lacks and writes every
        item to the connector. ValueError: the media's fault (a 400); ECTransferError: the connector's."""
        t0 = time.perf_counter()
        p = self.processor
        ids = [p.image_token_id] * len(media.get("image", [])) + [p.video_token_id] * len(media.get("video", []))
        _, items = p.process(ids, media, mm_processor_kwargs)
        with self._lock:
            fresh = {i.mm_hash for i in items if i.mm_hash not in self.state.encoder_cache}
            hits0 = self.state.encoder_cache.hits
            runs0 = self.state.num_encoder_runs
            out = self.state._encode(items)
            cached = self.state.encoder_cache.hits - hits0
            written, seen = 0, set()
            for item in items:
                if item.mm_hash in seen:
                    continue
                seen.add(item.mm_hash)
                if item.mm_hash not in fresh and self.connector.has(item.mm_hash):
                    continue  # written when it was encoded, and still there
                embeds, deepstack = out[item.mm_hash]
                written += self.connector.save(item.mm_hash, embeds, deepstack)
            encoded = len(seen) - cached if self.state.num_encoder_runs > runs0 else 0
        self.items_encoded += encoded
        self.items_cached += cached
        return EncodeResult([i.mm_hash for i in items], encoded, cached, written, time.perf_counter() - t0)

    def close(self) -> None:
        self.connector.close()
