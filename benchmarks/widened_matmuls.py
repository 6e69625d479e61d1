"""bf16 on the AVX2 class beyond the decoder's linears: the MoE experts' two paths and an encoder block's linears
(EncoderLinear), each in fp32, in bf16 through torch's own (oneDNN-emulated) matmuls, and in bf16 widened to fp32
per call (`KernelConfig.widen_bf16`, what the engine takes on that class). Medians of --rounds, one run, and the
emulated / widened ratio. Run it as the AVX2 class: on an AVX512-BF16 CPU force it with
VLLM_NEURON_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (the script says which it got).

    python benchmarks/widened_matmuls.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.model.layers.linear import EncoderLinear
from vllm_neuron.model.layers.moe import StackedExperts

from step_timing import median_ms

EMULATED, WIDENED = KernelConfig(), KernelConfig(widen_bf16=True)
EXPERTS = (32, 1024, 512)  # experts, hidden, intermediate (a Qwen3-MoE layer, scaled down)
VISION = (1024, 1152, 4304)  # patches, hidden, MLP (a Qwen3-VL-2B vision block's linears)


def timed_ms(fn: Callable[[], object], rounds: int) -> float:
    """The median of `rounds` calls after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median_ms(times)


def experts_cases(rounds: int) -> list[tuple[str, float, float, float]]:
    e, h, i = EXPERTS
    fp32 = StackedExperts(e, h, i)
    for p in fp32.parameters():
        nn.init.normal_(p, std=0.02)
    bf16 = StackedExperts(e, h, i)
    bf16.load_state_dict(fp32.state_dict())
    bf16 = bf16.bfloat16()
    rows = []
    for tokens, path in ((256, "dense"), (4, "gathered")):  # 4 tokens x top-4 <= 32 experts: gathered
        x = torch.randn(tokens, h)
        weights, ids = torch.softmax(torch.randn(tokens, 4), -1), torch.randint(0, e, (tokens, 4))
        times = [timed_ms(lambda: fp32(x, weights, ids), rounds)]
        for kernels in (EMULATED, WIDENED):
            bf16.kernels = kernels
            times.append(timed_ms(lambda: bf16(x.bfloat16(), weights.bfloat16(), ids), rounds))
        rows.append((f"experts {e} x {h} x {i}, {tokens} tokens top-4 ({path})", *times))
    return rows


def vision_case(rounds: int) -> tuple[str, float, float, float]:
    patches, h, m = VISION
    layers = [EncoderLinear(h, 3 * h), EncoderLinear(h, h), EncoderLinear(h, m), EncoderLinear(m, h)]
    inputs = [torch.randn(patches, layer.in_features) for layer in layers]

    def block(dtype: torch.dtype) -> None:
        for layer, x in zip(layers, inputs):
            layer(x.to(dtype))

    times = [timed_ms(lambda: block(torch.float32), rounds)]
    for layer in layers:
        layer.bfloat16()
    for kernels in (EMULATED, WIDENED):
        for layer in layers:
            layer.kernels = kernels
        times.append(timed_ms(lambda: block(torch.bfloat16), rounds))
    return (f"vision block's 4 linears, {patches} patches x {h} (MLP {m})", *times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"torch's CPU capability: {torch.backends.cpu.get_cpu_capability()} "
          "(AVX2 is the class this measures)", flush=True)
    print("| case | fp32 (ms) | bf16 emulated (ms) | bf16 widened (ms) | emulated / widened |")
    print("| --- | --- | --- | --- | --- |")
    with torch.no_grad():
        for name, fp32, emulated, widened in [*experts_cases(args.rounds), vision_case(args.rounds)]:
            print(f"| {name} | {fp32:.1f} | {emulated:.1f} | {widened:.1f} | {emulated / widened:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
