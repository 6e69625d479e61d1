"""Decode TPOT with LoRA adapters against the base model, one engine, one run.

Two engines on the bundled model (or --model) in one process: the base model (LoRA off) and --enable-lora
(--max-loras 4, --max-lora-rank 16) with four random rank-16 adapters on every projection (q/k/v/o,
gate/up/down) written as PEFT folders. Decode steps are timed one by one (benchmarks/step_timing.py, median
per configuration) at batch 1 and 16 with 0, 1 and 4 distinct adapters in the batch (4 only at batch 16),
interleaved over --repeat rounds so that load from elsewhere hits every configuration alike; ratios are
against the LoRA-off engine's median at the same batch (0 adapters with LoRA on: the delta's cost for base
requests, which still read slot 0).

`--kernels` times the delta alone (model/layers/lora.py's `lora_delta`: the gathered bmm path and the masked
dense path) on the model's projection shapes, against the time its weights take to stream at the machine's
measured read bandwidth (the bound of a decode-sized step).

    python benchmarks/lora_overhead.py [--model PATH] [--eager] [--max-tokens 64] [--repeat 3] [--kernels]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RANK = 16
SLOTS = 4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, shapes, seed: int) -> str:
    """A PEFT folder of a random rank-RANK adapter on every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in TARGETS:
            fan_in, fan_out = shapes.shapes[module]
            owner = "self_attn" if module in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) / RANK ** 0.5 * 0.1
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": RANK, "target_modules": list(TARGETS),
                   "bias": "none"}, f)
    return path


def engine_overhead(args) -> None:
    from benchmarks.step_timing import median_ms, steps_of, time_steps
    from vllm_neuron import LLM, SamplingParams
    from vllm_neuron.lora.peft_adapter import BaseShapes
    from vllm_neuron.lora.request import LoRARequest

    common = dict(enforce_eager=args.eager, max_num_seqs=16, max_model_len=512, enable_prefix_caching=False,
                  block_size=32, num_gpu_blocks_override=320)  # two engines side by side: a fixed small KV pool
    engines = {"off": LLM(args.model, **common),
               "on": LLM(args.model, **common, enable_lora=True, max_loras=SLOTS, max_lora_rank=RANK)}
    shapes = BaseShapes.from_hf_config(engines["on"].llm_engine.checkpoint.hf_config)
    tmp = tempfile.mkdtemp(prefix="lora_bench_")
    loras = [LoRARequest(f"bench{i}", i + 1, write_adapter(os.path.join(tmp, f"a{i}"), shapes, i))
             for i in range(SLOTS)]
    times = {k: time_steps(llm) for k, llm in engines.items()}
    vocab = shapes.shapes["q_proj"][0]  # token ids below the hidden size are valid in any vocabulary here
    # (engine, batch, distinct adapters): "off" is the engine without --enable-lora, the base of the ratios.
    configs = [("off", 1, 0), ("on", 1, 0), ("on", 1, 1), ("off", 16, 0), ("on", 16, 0), ("on", 16, 1),
               ("on", 16, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[tuple, list[float]] = {c: [] for c in configs}

    def run(engine: str, batch: int, distinct: int) -> list[float]:
        prompts = [{"prompt_token_ids": [(7 * i + j) % vocab + 3 for j in range(16)]} for i in range(batch)]
        lrs = [loras[i % distinct] if distinct else None for i in range(batch)]
        times[engine].clear()
        kw = {"lora_request": lrs} if engine == "on" else {}
        engines[engine].generate(prompts, params, use_tqdm=False, **kw)
        return steps_of(times[engine], "decode", batch)

    for c in configs:  # warm-up: graphs, adapter reads, slot writes
        run(*c)
    for _ in range(args.repeat):  # interleaved: load from elsewhere hits every configuration alike
        for c in configs:
            results[c].extend(run(*c))
    path = engines["on"].llm_engine.checkpoint.path
    print(f"model: {path} ({'eager' if args.eager else 'compiled'}); adapters: rank {RANK} on "
          f"{', '.join(TARGETS)}, --max-loras {SLOTS}; median decode step over {args.repeat} x {args.max_tokens} "
          "tokens")
    print(f"{'batch':>6s}  {'engine':<22s}{'adapters':>9s}{'TPOT ms':>10s}{'vs base':>9s}")
    for engine, batch, distinct in configs:
        ms = median_ms(results[(engine, batch, distinct)])
        label = "base (LoRA off)" if engine == "off" else "--enable-lora"
        print(f"{batch:6d}  {label:<22s}{distinct:9d}{ms:10.3f}{ms / median_ms(results[('off', batch, 0)]):9.3f}")


def kernels(args) -> None:
    import torch

    from vllm_neuron.model.layers.lora import lora_delta_dense, lora_delta_gathered

    n = 64 * 2**20
    src, dst = torch.ones(n), torch.empty(n)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    bandwidth = 2 * src.nbytes / best  # read + write
    h, inter = 576, 1536  # SmolLM2-135M's projections
    shapes = {"qkv": (h, 3 * RANK, h + 2 * 192), "o": (h, RANK, h), "gate_up": (h, 2 * RANK, 2 * inter),
              "down": (inter, RANK, h)}
    print(f"copy bandwidth ~{bandwidth / 1e9:.1f} GB/s; {SLOTS + 1} slots (slot 0 zero), fp32; per projection: "
          "median us per call, and the bound (the used slots' weights streamed once)")
    print(f"{'proj':>8s}{'rows':>6s}{'gather us':>11s}{'dense us':>10s}{'bound us':>10s}")
    for name, (fan_in, width, fan_out) in shapes.items():
        a, b = torch.randn(SLOTS + 1, width, fan_in), torch.randn(SLOTS + 1, width, fan_out)
        a[0], b[0] = 0, 0  # slot 0: the base model's
        for rows in (1, 16):
            x, idx = torch.randn(rows, fan_in), torch.arange(1, rows + 1) % (SLOTS + 1)
            used = min(rows, SLOTS)  # the distinct adapters the rows read
            bound = used * (a[1].nbytes + b[1].nbytes) / bandwidth * 1e6
            torch.testing.assert_close(lora_delta_gathered(x, idx, a, b), lora_delta_dense(x, idx, a, b),
                                       rtol=1e-3, atol=1e-2)
            gather = _best(lambda: lora_delta_gathered(x, idx, a, b)) * 1e6
            dense = _best(lambda: lora_delta_dense(x, idx, a, b)) * 1e6
            print(f"{name:>8s}{rows:6d}{gather:11.1f}{dense:10.1f}{bound:10.1f}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _best(fn, n: int = 50) -> float:
    fn()
    return statistics.median(_timed(fn) for _ in range(n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the bundled SmolLM2-135M)")
    p.add_argument("--eager", action="store_true", help="run the bucket graphs uncompiled (default: compiled)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kernels", action="store_true", help="time the shrink/expand alone against its bound")
    args = p.parse_args()
    if args.kernels:
        kernels(args)
    else:
        engine_overhead(args)


if __name__ == "__main__":
    main()
