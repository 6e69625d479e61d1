"""On PYTHONPATH for the `vllm-avx2` peer only: vLLM CPU picks its kernel library by asking torch whether
the CPU has AVX-512 (vllm/platforms/cpu.py, import_kernels), not by ATEN_CPU_CAPABILITY, so on an AVX-512
machine it would never load its AVX2 build. Every process of that server (the engine core is a spawned
child) answers no here, so vLLM loads `_C_AVX2`, the library an AVX2-only CPU gets."""
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
