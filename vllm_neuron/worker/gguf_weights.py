"""What a GGUF file's weights become in the engine, and the start-up log that says so.

The rule: every tensor is dequantized to the model dtype at load. With neuron_config.quantization "int8" every
linear layer is re-quantized to int8 from those weights; with "int4" a layer whose file tensors are all of at most
~4.5 bits (Q4_K, Q4_0, IQ4_XS, ...) goes to int4 and a layer the file keeps finer (Q5_x, Q6_K, Q8_0, a float type:
e.g. a Q4_K_M file's Q6_K attn_v / ffn_down and output, or the Q8_0 embedding a tied lm_head shares) to int8, so
that re-quantizing never throws away precision the file kept. The error against the dequantized weights is
measured per layer and logged.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_neuron.logger import init_logger
from vllm_neuron.model.layers import quant_error
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.loader import Checkpoint, gguf_cache, gguf_loader

logger = init_logger(__name__)


def layer_schemes(model: nn.Module, hf_types: dict[str, str], scheme: str) -> dict[str, str]:
    """Linear module name -> the scheme it is quantized to: `scheme`, except int8 under "int4" for a layer with a
    file tensor finer than 4 bits (found through the model's own checkpoint_target, so fused q/k/v and gate/up
    and a tied lm_head see every tensor they hold)."""
    if scheme != "int4":
        return {}
    param_names = {id(p): n for n, p in model.named_parameters()}  # a tied weight under its first owner
    param_types: dict[str, set[str]] = {}
    for hf_name, qtype in hf_types.items():
        target = model.checkpoint_target(hf_name) if "{e}" not in hf_name else None
        if target is not None:
            param_types.setdefault(target[0], set()).add(qtype)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quantization is None:
            types = param_types.get(param_names.get(id(module.weight), ""), set())
            if types - set(gguf_loader.FOUR_BITS_OR_FEWER):
                out[name] = "int8"
    return out


def log_gguf_weights(ckpt: Checkpoint, dtype: torch.dtype, scheme: str | None,
                     errors: dict[str, quant_error.QuantError], schemes: dict[str, str],
                     honoured: tuple[str, ...], packed_mxfp4: bool = False) -> None:
    """The rule as it applied to this load; without a scheme, the one that would keep the file quantized is named
    when the model honours it. `packed_mxfp4`: the model keeps its experts MXFP4 (gpt-oss under "mxfp4")."""
    types = gguf_loader.count_types(gguf_cache.hf_types(ckpt.gguf_file))
    listed = ", ".join(f"{t} x{n}" for t, n in types.items())
    to = str(dtype).removeprefix("torch.")
    if scheme is not None:
        finer = sum(1 for s in schemes.values() if s != scheme)
        kept = f" ({finer} of the layers to int8: the file holds them finer than 4 bits)" if finer else ""
        logger.info("GGUF tensors (%s) dequantized to %s, then the linear weights re-quantized to %s%s; error against "
                    "the dequantized weights: %s", listed, to, scheme, kept, quant_error.summarize(errors))
        return
    if packed_mxfp4:
        logger.info("GGUF tensors (%s): the experts held in MXFP4 (the file's MXFP4 blocks as they are, other expert "
                    "types quantized to it), the rest dequantized to %s", listed, to)
        return
    quantized = [t for t in types if t not in gguf_loader.FLOAT_TYPES]
    if quantized and max(quantized, key=lambda t: types[t]) == "MXFP4" and "mxfp4" in honoured:
        logger.info("GGUF tensors (%s) dequantized to %s; neuron_config.quantization 'mxfp4' would keep the MXFP4 "
                    "experts packed (fewer bytes per decode step, exact)", listed, to)
        return
    hint = gguf_loader.suggested_quantization(types)
    hint = hint if hint in honoured else None
    logger.info("GGUF tensors (%s) dequantized to %s%s", listed, to,
                f"; neuron_config.quantization '{hint}' would re-quantize the linear weights onto the weight-only "
                "kernels (fewer bytes per decode step; the error is logged)" if hint else "")
