"""vLLM's command-line flags <-> EngineConfig fields.

Flags for features that exist in vLLM but not here yet are still parsed, so that using one gives a
clear "not supported yet" error from EngineConfig instead of argparse's "unrecognized argument".
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from vllm_neuron.config.device import DEVICE_CHOICES, DTYPE_CHOICES
from vllm_neuron.config.engine_config import EngineConfig


def _json_arg(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    if model_positional:
        g.add_argument("model", nargs="?", default=None,
                       help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or .gguf (default: the model's)")
    g.add_argument("--served-model-name", nargs="+", default=None, help="name(s) the API reports")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="max concurrent sequences (default: the largest num_seqs_bucket, else 16)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="max tokens per prefill step; longer prompts are segmented (default: the largest "
                   "num_batched_tokens_bucket, else min(512, max-model-len))")
    g.add_argument("--block-size", type=int, default=d.block_size, help="KV cache block size in tokens")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="number of KV cache blocks")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of device (host RAM on CPU) memory for the KV budget")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enforce-eager", action="store_true", help="run the bucket graphs uncompiled")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", choices=DEVICE_CHOICES, help="auto picks CUDA when present")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--enable-expert-parallel", action="store_true")
    g.add_argument("--kv-cache-dtype", default="auto")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    g.add_argument("--enable-prompt-embeds", action="store_true")
    g.add_argument("--speculative-config", type=_json_arg, default=None)
    g.add_argument("--kv-transfer-config", type=_json_arg, default=None)
    g.add_argument("--ec-transfer-config", type=_json_arg, default=None)
    g.add_argument("--mm-encoder-only", action="store_true")
    g.add_argument("--limit-mm-per-prompt", type=_json_arg, default=None)
    g.add_argument("--chat-template", default=None, help="Jinja chat template (text or file path)")
    g.add_argument("--trust-remote-code", action="store_true", help="accepted; no remote code is ever run")
    g.add_argument("--disable-log-stats", action="store_true")
    g.add_argument("--additional-config", type=_json_arg, default=None,
                   help='JSON, e.g. \'{"neuron_config": {"num_seqs_buckets": [1, 2, 4, 8]}}\'')
    g.add_argument("--quantization", "-q", default=None,
                   help="vLLM's flag; not used: quantization comes from neuron_config or the checkpoint")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    if getattr(args, "quantization", None):
        raise ValueError(f"--quantization {args.quantization} is not supported: keep it unset and use "
                         "neuron_config.quantization or a quantized checkpoint")
    model = getattr(args, "model", None)
    flag = getattr(args, "model_flag", None)
    if model and flag and model != flag:
        raise ValueError(f"conflicting models: positional {model!r} and --model {flag!r}")
    names = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
    kwargs = {k: v for k, v in vars(args).items() if k in names and k != "model"}
    return EngineConfig.from_kwargs(model=model or flag, **kwargs)
