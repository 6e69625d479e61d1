"""Building a model for an engine: construct it on the device in the compute dtype, hand it the engine's
kernel choice, load its weights (FP8 checkpoints, FP8 KV scales), quantize it (int8 / int4; a GGUF's layers by
gguf_weights.py's rule), move its weights into huge pages and pack them once for the tile kernels; and zeroed KV
memory that costs nothing until used."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from vllm_neuron import huge_pages
from vllm_neuron.config.device import check_weight_quantization
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.config.neuron_config import EncoderNeuronConfig
from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.logger import init_logger
from vllm_neuron.model.base import ModelSpec
from vllm_neuron.model.layers import kv_quant, quant_error, quant_fp8
from vllm_neuron.model.layers.kernel_config import KernelConfig, apply_kernel_config
from vllm_neuron.model.layers.kernels.cpu_caps import describe_copies
from vllm_neuron.model.layers.linear import (
    make_linears_fp8_,
    pack_linears_,
    packed_bytes,
    quantize_linears_,
    tile_bytes,
)
from vllm_neuron.model.loader import Checkpoint, gguf_cache
from vllm_neuron.model.qwen3_vl.vision_parallel import VisionParallel, group_ranks
from vllm_neuron.worker import gguf_weights, memory

logger = init_logger(__name__)


@dataclass
class LoadStats:
    seconds: float
    nbytes: int


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed KV memory. On CPU the OS maps it lazily, so a multi-GiB cache costs nothing until used
    (torch.zeros would touch every page at start): in 2 MiB pages where VLLM_NEURON_KV_HUGE_PAGES asks for
    them (huge_pages.kv_wanted), else from calloc through numpy."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if huge_pages.kv_wanted(torch.Size(shape).numel() * torch.finfo(dtype).bits // 8, device):
        return huge_pages.zeros(shape, dtype)
    bits = torch.finfo(dtype).bits
    raw = np.zeros(shape, dtype={8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}[bits])
    return torch.from_numpy(raw).view(dtype)


def checkpoint_scheme(ckpt: Checkpoint, spec: ModelSpec, config: EngineConfig) -> tuple[str | None, list[str]]:
    """(the checkpoint's own weight quantization or None, the modules it leaves unquantized); FP8 static
    weights come from the checkpoint's quantization_config (any other scheme is refused here)."""
    scheme, unquantized = quant_fp8.checkpoint_weight_scheme(ckpt.hf_config, spec.quantizations)
    if scheme and config.neuron_config.quantization:
        raise ValueError(f"neuron_config.quantization={config.neuron_config.quantization!r} cannot apply to a "
                         f"checkpoint whose weights are already quantized ({scheme}); remove it")
    return scheme, unquantized


def encoder_parallel(config: EngineConfig) -> VisionParallel:
    """The vision tower's TP / DP place over this engine's tensor-parallel ranks (encoder_neuron_config;
    full DP when it says nothing), its process groups made here, in the same order on every rank."""
    info = ps.info()
    if info.world == 1:
        return VisionParallel()
    enc = config.additional_config.encoder_neuron_config or EncoderNeuronConfig()
    tp, dp = enc.parallel_sizes(info.world)
    tp_groups, dp_groups = group_ranks(tp, dp)
    return VisionParallel(tp, dp, info.rank, ps.new_subgroups(tp_groups) if tp > 1 else None,
                          ps.new_subgroups(dp_groups) if dp > 1 else None)


def build_model(cls: type, ckpt: Checkpoint, config: EngineConfig, spec: ModelSpec, dtype: torch.dtype,
                device: torch.device, kernels: KernelConfig) -> tuple[torch.nn.Module, int]:
    """(the loaded model, bytes of weights loaded)."""
    scheme, unquantized = checkpoint_scheme(ckpt, spec, config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            extra = {"language_model_only": config.additional_config.mm_language_model_only} \
                if getattr(cls, "multimodal", False) else {}
            if getattr(cls, "takes_encoder_parallel", False):
                extra["encoder_parallel"] = encoder_parallel(config)
            if getattr(cls, "takes_max_model_len", False):  # e.g. Phi-3's LongRoPE picks its factors by it
                extra["max_model_len"] = config.max_model_len
            model = cls(ckpt.hf_config, quantization=config.neuron_config.quantization, **extra)
    finally:
        torch.set_default_dtype(prev)
    apply_kernel_config(model, kernels)
    if scheme == "fp8":
        n = make_linears_fp8_(model, unquantized)
        logger.info("FP8 static weights (ModelOpt checkpoint): %d linear layers hold float8_e4m3fn weights "
                    "and compute in %s", n, dtype)
    kv_dtype = kv_quant.kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
    kv_scales: list[str] = []
    nbytes = model.load_weights(tqdm(kv_quant.tap_scales(ckpt.iter_weights(dtype), kv_scales),
                                     desc="Loading weights", unit="tensor", leave=False, disable=None))
    if kv_quant.is_fp8(kv_dtype):
        kv_quant.log_scales(config.kv_cache_dtype, kv_scales, model.kv_cache_spec()[0])
    model = model.eval().requires_grad_(False)
    quantization = config.neuron_config.quantization
    scheme = quantization if quantization in ("int8", "int4") else None  # mxfp4: the gpt-oss experts' own loading
    errors: dict[str, quant_error.QuantError] = {}
    schemes = gguf_weights.layer_schemes(model, gguf_cache.hf_types(ckpt.gguf_file), scheme) \
        if ckpt.is_gguf and scheme else {}
    if scheme is not None:
        check_weight_quantization(scheme, dtype, device)
        tiles = kernels.int8_activations and tiles_fit_memory(model, scheme, schemes)
        if config.neuron_config.int8_activations and not tiles:
            raise ValueError("neuron_config.int8_activations=True cannot be honoured: the int8-activation copies of "
                             f"the {scheme} weights do not fit in half of the host's available memory; set it to "
                             "false or leave it unset")
        layers, before, after = quantize_linears_(model, scheme, errors if ckpt.is_gguf else None, schemes,
                                                  tiles=tiles)
        logger.info("Weight-only %s: %d linear layers, %.1f MiB -> %.1f MiB (%s kernel for decode%s)", scheme,
                    layers, before / 2**20, after / 2**20, "custom" if kernels.quant_rows else "no",
                    _tiles_note(scheme) if tiles else "")
    if ckpt.is_gguf:
        gguf_weights.log_gguf_weights(ckpt, dtype, scheme, errors, schemes, spec.quantizations,
                                      packed_mxfp4=quantization == "mxfp4")
    if device.type == "cpu" and huge_pages.available():
        moved, moved_bytes = huge_pages.move_parameters_(model)
        logger.info("Weights in 2 MiB pages: %d tensors, %.1f MiB (VLLM_NEURON_HUGE_PAGES=0 keeps 4 KiB ones)",
                    moved, moved_bytes / 2**20)
    if kernels.prepacked:
        pack_weights(model, kernels)
    return model, nbytes


def _tiles_note(scheme: str) -> str:
    if scheme == "int4":
        return "; int8 activations at every row count, the int4 weights in tile order"
    return "; from 2 rows on int8 activations, a second copy of the int8 weights in tile order"


def tiles_fit_memory(model: torch.nn.Module, scheme: str, schemes: dict[str, str] | None = None) -> bool:
    """Whether the int8-activation kernels' copies of the `scheme` (or `schemes[module name]`) weights fit: not
    where they would add more than half the host's available memory (the model then serves every row from its
    bands, as with neuron_config.int8_activations=false). int4's copies replace its bands: they always fit."""
    need, free = tile_bytes(model, scheme, schemes), memory.host_available_bytes()
    if need > free // 2:
        logger.warning("No int8-activation copies of the %s weights: they (%.1f MiB) would take more than half of "
                       "the host's available memory (%.1f MiB); full-precision activations", scheme,
                       need / 2**20, free / 2**20)
        return False
    return True


def pack_weights(model: torch.nn.Module, kernels: KernelConfig) -> None:
    """Packed copies of the bf16 linear weights for the rows above the decode kernel's (packed_weights.py),
    unless they would take more than half of the host's available memory: a model that fits once may
    not fit twice, and without its copy a weight takes F.linear (same results, same graphs)."""
    need, free = packed_bytes(model), memory.host_available_bytes()
    if need > free // 2:
        logger.warning("Weights not packed: the copies (%.1f MiB) would take more than half of the "
                       "host's available memory (%.1f MiB); F.linear serves the rows above %d", need / 2**20,
                       free / 2**20, kernels.linear_rows)
        return
    t0 = time.perf_counter()
    layers, added = pack_linears_(model)
    logger.info("Weights packed once: %d bf16 linear layers above %d rows, %s (+%.1f MiB beside the weights "
                "the decode kernel streams; %.1f s)", layers, kernels.linear_rows, describe_copies(), added / 2**20,
                time.perf_counter() - t0)
